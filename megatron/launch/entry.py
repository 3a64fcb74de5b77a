"""DeepSpeed's per-node launcher (deepspeed.launcher.launch) as deepy.py starts it: with SIGTERM and
SIGINT blocked.

Every rank the launcher starts inherits the blocked signals. The launcher's own handler, which would
SIGTERM the ranks and kill them 30 s later, never acts on one; each rank takes them in a thread of
its own once it has started (megatron/runtime/stop_signals.py), so one sent while it starts waits for
it (a train script of one's own does the same with StopSignals().install(), else only a second
request, which kills, stops it). A signal sent to this process is passed on to deepy.py (its
parent), which passes it on to the ranks. DeepSpeed's launcher does the launching, run here as
`python -m deepspeed.launcher.launch` would run it. Used for ranks on this machine only
(megatron/launch/launcher.py).

    python -m megatron.launch.entry LAUNCHER_ARGS...
"""

from __future__ import annotations

import os
import runpy
import signal
import threading

from megatron.processes import skip_collection_at_exit
from megatron.runtime.stop_signals import STOP_SIGNALS

NODE_LAUNCHER_MODULE = "deepspeed.launcher.launch"


def pass_signals_on(supervisor_pid: int) -> None:
    while True:
        signum = signal.sigwait(STOP_SIGNALS)
        try:
            os.kill(supervisor_pid, signum)
        except ProcessLookupError:
            return


def main() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # before any thread or child exists: all inherit it
    threading.Thread(target=pass_signals_on, args=(os.getppid(),), daemon=True).start()
    try:
        runpy.run_module(NODE_LAUNCHER_MODULE, run_name="__main__", alter_sys=True)  # reads its flags from sys.argv
    finally:
        skip_collection_at_exit()


if __name__ == "__main__":
    main()
