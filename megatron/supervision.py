"""deepy.py's watch over a run: DeepSpeed's launcher in its own process group, SIGTERM/SIGINT passed
on to the ranks, and no process of the run left behind when deepy.py ends.

The first SIGTERM or SIGINT goes to the ranks only (not to DeepSpeed's per-node launcher, which
would kill them 30 s later): they finish their step, save and exit 0 (megatron/stop_signals.py).
A second one goes to the ranks and the whole group: they stop at once. When the launcher has
exited, whatever is left in its group is killed. A small watchdog process kills the group when
deepy.py itself dies without cleaning up (SIGKILL, a closed terminal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from megatron.stop_signals import STOP_SIGNALS, signal_name

# The per-node launcher DeepSpeed's runner starts; its children are the ranks.
NODE_LAUNCHER_MODULE = "deepspeed.launcher.launch"
# After a second signal, what has not stopped (a rank stuck in a collective does not run its
# Python signal handler) is killed after this long.
SECOND_SIGNAL_GRACE_SECONDS = 10.0

WATCHDOG = """
import os, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
if not sys.stdin.buffer.read(1):  # end of file: deepy.py died without saying goodbye
    try:
        os.killpg(int(sys.argv[1]), signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def rank_processes(launcher_pid: int) -> list[int]:
    """Pids of the ranks this machine's DeepSpeed launcher started (children of its per-node launcher)."""
    import psutil

    try:
        tree = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return []
    ranks = []
    for process in tree:
        try:
            parent = process.parent()
            if parent is not None and NODE_LAUNCHER_MODULE in parent.cmdline():
                ranks.append(process.pid)
        except psutil.Error:
            continue
    return ranks


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _send_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Runs one launcher command to its end; `run()` returns deepy.py's exit status."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.command = command
        self.env = env
        self.signals: list[int] = []
        self.launcher: subprocess.Popen | None = None
        self.kill_timer: threading.Timer | None = None

    def run(self) -> int:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        try:
            self.launcher = subprocess.Popen(self.command, env=self.env, start_new_session=True)
            watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(self.launcher.pid)],
                                        stdin=subprocess.PIPE, start_new_session=True)
            try:
                returncode = self._wait_and_clean_up()
            finally:
                watchdog.stdin.write(b"x")  # goodbye: the group is already cleaned up
                watchdog.stdin.close()
                watchdog.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self._exit_status(returncode)

    def _wait_and_clean_up(self) -> int:
        pid = self.launcher.pid
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: its group id stays ours
        if self.kill_timer is not None:
            self.kill_timer.cancel()
        _send_group(pid, signal.SIGKILL)
        return self.launcher.wait()

    def _on_signal(self, signum: int, frame) -> None:
        self.signals.append(signum)
        if self.launcher is None:
            raise SystemExit(128 + signum)  # nothing started yet
        group = self.launcher.pid
        if len(self.signals) > 2:
            _send_group(group, signal.SIGKILL)
            return
        ranks = rank_processes(group)
        for pid in ranks:
            _send(pid, signum)
        if len(self.signals) == 2 or not ranks:
            _send_group(group, signum)
        if len(self.signals) == 2:
            self.kill_timer = threading.Timer(SECOND_SIGNAL_GRACE_SECONDS, _send_group, (group, signal.SIGKILL))
            self.kill_timer.daemon = True
            self.kill_timer.start()

    def _exit_status(self, returncode: int) -> int:
        if len(self.signals) >= 2:
            print(f"deepy.py: stopped at once by a second {signal_name(self.signals[-1])}; no checkpoint "
                  "was saved for the current step", file=sys.stderr, flush=True)
            return 128 + self.signals[-1]
        if returncode < 0:
            return 128 - returncode
        return returncode
