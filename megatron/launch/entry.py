"""DeepSpeed's runner (`deepspeed`) as deepy.py starts it: with SIGTERM and SIGINT blocked.

Every process the runner starts inherits the blocked signals. DeepSpeed's per-node launcher
(deepspeed.launcher.launch), whose own handler would SIGTERM the ranks and kill them 30 s later,
never acts on one; each rank takes them in a thread of its own once it has started
(megatron/runtime/stop_signals.py), so one sent while it starts waits for it (a train script of one's own
does the same with StopSignals().install(), else only a second request, which kills, stops it).
A signal sent to the runner itself is passed on to deepy.py (its parent), which passes it on to
the ranks. Still DeepSpeed's runner does the launching. Used on one machine only (megatron/launch/launcher.py).

    python -m megatron.launch.entry RUNNER_ARGS...
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from megatron.runtime.stop_signals import STOP_SIGNALS


def pass_signals_on(supervisor_pid: int) -> None:
    while True:
        signum = signal.sigwait(STOP_SIGNALS)
        try:
            os.kill(supervisor_pid, signum)
        except ProcessLookupError:
            return


def main(runner_args: list[str]) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # before any thread or child exists: all inherit it
    threading.Thread(target=pass_signals_on, args=(os.getppid(),), daemon=True).start()
    from deepspeed.launcher import runner

    runner.main(runner_args)


if __name__ == "__main__":
    main(sys.argv[1:])
