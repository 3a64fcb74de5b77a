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

When ranks fail, DeepSpeed's launcher exits with the return code of whichever failed rank its next poll
(once a second) finds first; the ranks that only lost their connection to a killed one often end within
that second. A rank killed by a signal (the out-of-memory killer's SIGKILL) says nothing of its own, so
when the first rank to end was killed by one, this process exits with that rank's status (-N) instead,
and deepy.py names the signal as the run's cause.

    python -m megatron.launch.entry LAUNCHER_ARGS...
"""

from __future__ import annotations

import os
import runpy
import signal
import threading
import time

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


class FirstRankEnd:
    """Watches for the first child (a rank) to end, leaving it to the launcher to reap; `signal` is the signal
    that killed it, None when it exited by itself or none has ended."""

    def __init__(self):
        self.signal: int | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)  # blocks until a child ends
            except ChildProcessError:  # the launcher has not started the ranks yet
                time.sleep(0.1)
                continue
            if ended is not None and ended.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
                self.signal = ended.si_status
            return


def main() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # before any thread or child exists: all inherit it
    threading.Thread(target=pass_signals_on, args=(os.getppid(),), daemon=True).start()
    first_end = FirstRankEnd()
    try:
        runpy.run_module(NODE_LAUNCHER_MODULE, run_name="__main__", alter_sys=True)  # reads its flags from sys.argv
    except SystemExit as launcher_exit:
        if launcher_exit.code not in (0, None) and first_end.signal is not None:
            raise SystemExit(-first_end.signal) from None
        raise
    finally:
        skip_collection_at_exit()


if __name__ == "__main__":
    main()
