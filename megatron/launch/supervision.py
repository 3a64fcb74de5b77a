"""deepy.py's watch over a run: the processes it starts in a process group of their own, SIGTERM/SIGINT
passed on to the ranks, and no process of the run left behind when deepy.py ends.

On one machine deepy.py starts the ranks itself (megatron/launch/launcher.py), with the stop signals
blocked: each rank takes them in a thread of its own once it has started (megatron/runtime/stop_signals.py),
so one sent while it starts waits for it. Whichever processes of the run a SIGTERM or SIGINT reaches
(deepy.py, a rank, all of them at once), the ranks learn of it: deepy.py passes a first request on to
every rank. They finish their step, save and exit 0. A second request kills the whole group at once.
When a rank fails, the others get a moment to end on their own (those that only lost their connection
to it do), then the group is killed; deepy.py exits with the status of the first rank that failed. When
every rank has ended, whatever is left in the group (a rank's data workers) is killed. A small watchdog
process kills the group when deepy.py itself dies without cleaning up (SIGKILL, a closed terminal).
With ranks on other machines deepy.py starts DeepSpeed's runner as it is there; a first request goes
to it, and its own handler stops them.

A rank that fails hands its one line to deepy.py (megatron/runtime/rank_errors.py), which prints it last, once
every process of the run has ended.
"""

from __future__ import annotations

import atexit
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from megatron.launch.launcher import RankCommand
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


def _signal_that_ended(returncode: int) -> int | None:
    """The signal that killed a rank: its return code is -N; DeepSpeed's runner exits with a failed rank's
    return code, which for a rank killed by signal N is an exit status of 256 - N."""
    number = -returncode if returncode < 0 else 256 - returncode
    return number if 0 < number < 256 and number in set(signal.valid_signals()) else None


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


# How long the other ranks have to end on their own once one failed, before the group is killed.
FAILED_RUN_GRACE_SECONDS = 5.0


class Supervisor:
    """Runs the processes of one launch to their end; `run()` returns deepy.py's exit status.

    `ranks` are this machine's ranks (RankCommand each), or the one command of DeepSpeed's runner when
    `ranks_here` is False (the ranks are then, also, on other machines, out of our reach)."""

    def __init__(self, ranks: list[RankCommand], *, ranks_here: bool = True):
        self.commands = ranks
        self.ranks_here = ranks_here
        self.requests = StopRequests()
        self.processes: list[subprocess.Popen] = []
        self.running: set[int] = set()  # pids of the processes that have not ended

    def run(self) -> int:
        # Blocked while the ranks start, so that they start with them blocked.
        blocked = STOP_SIGNALS if self.ranks_here else ()
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        rank_errors = tempfile.NamedTemporaryFile(prefix="neox-rank-errors-")
        # only the ranks of this machine can write to it; those on other machines print their own lines
        extra_env = {RANK_ERRORS_FILE: rank_errors.name} if self.ranks_here else {}
        try:
            try:
                self._start(extra_env)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
            if self.requests.count:  # arrived while the ranks were starting (see _on_signal)
                self._pass_on_request(self.requests.first)
            watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(self.group)],
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
            killer = None if self.requests.count else _signal_that_ended(returncode)
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

    @property
    def group(self) -> int:
        return self.processes[0].pid

    def _start(self, extra_env: dict[str, str]) -> None:
        """Each process in the group of the first (a group of its own: a Ctrl-C to the terminal's group reaches
        deepy.py alone, which passes it on)."""
        try:
            for command in self.commands:
                group = self.group if self.processes else 0
                process = subprocess.Popen(command.argv, env={**command.env, **extra_env}, process_group=group)
                self.processes.append(process)
                self.running.add(process.pid)
        except BaseException:
            if self.processes:  # none may run on without the others
                _send_group(self.group, signal.SIGKILL)
            raise

    def _wait_and_clean_up(self) -> int:
        """The return code of the first process that failed (0 when none did). Each stays unreaped until the
        group is killed, so that the group's id stays ours."""
        ended: queue.Queue = queue.Queue()
        for process in self.processes:
            threading.Thread(target=_report_end, args=(process.pid, ended), daemon=True).start()
        failed, deadline = 0, None
        while self.running:
            try:
                pid, returncode = ended.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break  # the others did not end on their own after a failure
            self.running.discard(pid)
            if returncode != 0 and not failed:
                failed, deadline = returncode, time.monotonic() + FAILED_RUN_GRACE_SECONDS
        _send_group(self.group, signal.SIGKILL)
        for process in self.processes:
            process.wait()
        return failed

    def _on_signal(self, signum: int, frame) -> None:
        if not self.requests.add(signum):
            return  # a copy: the scheduler signalled every process
        if not self.processes:
            # Blocked in the main thread while the ranks start, a signal can still reach another thread of
            # deepy.py (one an imported library started), and Python runs this handler in the middle of
            # Popen: it is passed on once the ranks exist.
            return
        self._pass_on_request(signum)

    def _pass_on_request(self, signum: int) -> None:
        if self.requests.count > 1:
            _send_group(self.group, signal.SIGKILL)
        elif self.ranks_here:
            for pid in list(self.running):
                _send(pid, signum)
        else:
            _send_group(self.group, signum)  # DeepSpeed's runner stops the other machines' ranks its own way

    def _exit_status(self, returncode: int) -> int:
        if self.requests.count >= 2:
            print(f"deepy.py: stopped at once by a second {signal_name(self.requests.first)}; no checkpoint "
                  "was saved for the current step", file=sys.stderr, flush=True)
            return 128 + self.requests.first
        if returncode < 0:
            return 128 - returncode
        return returncode


def _report_end(pid: int, ended: queue.Queue) -> None:
    """Put (pid, return code) on `ended` once process `pid` has ended, leaving it unreaped; nothing when the
    supervisor reaped it first (it stopped waiting: another process failed and the group was killed)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return
    killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
    ended.put((pid, -info.si_status if killed else info.si_status))
