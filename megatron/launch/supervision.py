"""deepy.py's watch over a run: DeepSpeed's launcher in its own process group, SIGTERM/SIGINT passed
on to the ranks, and no process of the run left behind when deepy.py ends.

Whichever processes of the run a SIGTERM or SIGINT reaches (deepy.py, DeepSpeed's launcher, a rank,
all of them at once), the ranks learn of it: DeepSpeed's per-node launcher never acts on one and
passes it on to deepy.py (megatron/launch/entry.py), which passes a first request on to the ranks. They finish their step, save and exit 0 (megatron/runtime/stop_signals.py). A second
request kills the whole group at once. Before any rank exists there is nothing to save: the group
is killed and deepy.py exits 0. When the launcher has exited, whatever is left in its group is
killed. A small watchdog process kills the group when deepy.py itself dies without cleaning up
(SIGKILL, a closed terminal). With ranks on other machines, a first request without local ranks
goes to DeepSpeed's runner, started as it is there, whose own handler stops them.

A rank that fails hands its one line to deepy.py (megatron/runtime/rank_errors.py), which prints it last, once
every process of the run has ended.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron.runtime.rank_errors import RANK_ERRORS_FILE, first_rank_error
from megatron.runtime.stop_signals import STOP_SIGNALS, StopRequests, signal_name

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


def _signal_that_ended_a_rank(launcher_status: int) -> int | None:
    """The signal that killed a rank, read from the per-node launcher's exit status: it exits with the first
    failed rank's return code, which for a rank killed by signal N is -N, an exit status of 256 - N."""
    number = 256 - launcher_status
    return number if 0 < launcher_status < 256 and number in set(signal.valid_signals()) else None


def _say_stopped_before_any_rank(signum: int) -> None:
    print(f"deepy.py: stopped by {signal_name(signum)} before any rank started; nothing to save",
          file=sys.stderr, flush=True)


_signal_before_launch: int | None = None


def _stop_before_launch(signum: int, frame) -> None:
    global _signal_before_launch
    _signal_before_launch = _signal_before_launch or signum
    raise SystemExit(0)  # from wherever deepy.py is (importing, checking settings): no traceback


def _say_if_stopped_before_launch() -> None:
    if _signal_before_launch is not None:
        _say_stopped_before_any_rank(_signal_before_launch)


def stop_quietly_before_launch() -> None:
    """Until the launcher starts, a stop signal ends deepy.py with one line (its last) and exit status 0."""
    atexit.unregister(_say_if_stopped_before_launch)  # once, however often this is called
    atexit.register(_say_if_stopped_before_launch)
    for signum in STOP_SIGNALS:
        signal.signal(signum, _stop_before_launch)


def exit_if_stopped_before_launch() -> None:
    """Ends deepy.py (exit status 0) when a stop signal came before the launch but its SystemExit was swallowed:
    the handler can run inside a C extension's import that clears any error it meets (torch's import of numpy
    does), and deepy.py would otherwise go on to start the run it was asked to stop."""
    if _signal_before_launch is not None:
        raise SystemExit(0)


def rank_processes(launcher_pid: int) -> list[int]:
    """Pids of the ranks DeepSpeed's per-node launcher started on this machine: its children."""
    import psutil

    try:
        return [process.pid for process in psutil.Process(launcher_pid).children()]
    except psutil.Error:
        return []


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

    def __init__(self, command: list[str], env: dict[str, str], *, one_machine: bool = True):
        self.command = command
        self.env = env
        self.one_machine = one_machine  # else the ranks are (also) on other machines, out of our reach
        self.requests = StopRequests()
        self.stopped_before_ranks = False
        self.launcher: subprocess.Popen | None = None

    def run(self) -> int:
        # On one machine blocked while the launcher starts, so that it starts with them blocked (the entry
        # keeps them so).
        blocked = STOP_SIGNALS if self.one_machine else ()
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        rank_errors = tempfile.NamedTemporaryFile(prefix="neox-rank-errors-")
        # only the ranks of this machine can write to it; those on other machines print their own lines
        env = {**self.env, RANK_ERRORS_FILE: rank_errors.name} if self.one_machine else self.env
        try:
            try:
                self.launcher = subprocess.Popen(self.command, env=env, start_new_session=True)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
            if self.requests.count:  # arrived while the launcher was starting (see _on_signal)
                self._pass_on_request(self.requests.first)
            watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(self.launcher.pid)],
                                        stdin=subprocess.PIPE, start_new_session=True)
            try:
                returncode = self._wait_and_clean_up()
            finally:
                watchdog.stdin.write(b"x")  # goodbye: the group is already cleaned up
                watchdog.stdin.close()
                watchdog.wait()
            status = self._exit_status(returncode)
            rank_error = first_rank_error(Path(rank_errors.name))
            if rank_error is not None:
                print(rank_error, file=sys.stderr, flush=True)
            killer = None if self.requests.count else _signal_that_ended_a_rank(returncode)
            if killer is not None:  # the cause: the other ranks' lines (a lost connection) are its consequences
                why = (": a process outside this run sent it, on Linux most often the out-of-memory killer (`dmesg` "
                       "names what it killed)" if killer == signal.SIGKILL else "")
                print(f"deepy.py: a rank was ended by {signal_name(killer)} without a message of its own{why}",
                      file=sys.stderr, flush=True)
            return status
        finally:
            rank_errors.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _wait_and_clean_up(self) -> int:
        pid = self.launcher.pid
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: its group id stays ours
        _send_group(pid, signal.SIGKILL)
        return self.launcher.wait()

    def _on_signal(self, signum: int, frame) -> None:
        if not self.requests.add(signum):
            return  # a copy: the scheduler signalled every process, or the launcher passed it on
        if self.launcher is None:
            # Blocked in the main thread while the launcher starts, a signal can still reach another thread
            # of deepy.py (one an imported library started), and Python runs this handler in the middle of
            # Popen: it is passed on once the launcher exists.
            return
        self._pass_on_request(signum)

    def _pass_on_request(self, signum: int) -> None:
        group = self.launcher.pid
        if self.requests.count > 1:
            _send_group(group, signal.SIGKILL)
            return
        ranks = rank_processes(group) if self.one_machine else []
        if ranks:
            for pid in ranks:
                _send(pid, signum)
        elif self.one_machine:
            self.stopped_before_ranks = True
            _send_group(group, signal.SIGKILL)
        else:
            _send_group(group, signum)  # DeepSpeed's runner stops the other machines' ranks its own way

    def _exit_status(self, returncode: int) -> int:
        if self.requests.count >= 2:
            print(f"deepy.py: stopped at once by a second {signal_name(self.requests.first)}; no checkpoint "
                  "was saved for the current step", file=sys.stderr, flush=True)
            return 128 + self.requests.first
        if self.stopped_before_ranks:
            _say_stopped_before_any_rank(self.requests.first)
            return 0
        if returncode < 0:
            return 128 - returncode
        return returncode
