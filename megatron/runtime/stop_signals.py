"""SIGTERM/SIGINT on a rank: the first one stops the run after the current step (with a checkpoint),
a second one stops the process at once.

Schedulers send SIGTERM to every process of a job some time before they kill it; deepy.py also
passes a signal it gets on to every rank. One request therefore reaches a rank as several copies
within moments: signals within SAME_REQUEST_SECONDS of the first are copies of it, a later one is a
second request. A rank only notes the signal; the training loop asks `agreed_stop()` once per step
(and once before the first), which gathers every rank's note, so every rank stops after the same step
even when the signal reached them during different steps, or reached only one of them. When a rank
fails, deepy.py kills the others (megatron/launch/supervision.py): waiting for the step to end could
mean waiting in a collective for the failed rank, for ever.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from megatron.ranks import global_rank
from megatron.runtime import faults
from megatron.runtime.collective import reported_by_ranks

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Copies of one request (the scheduler's own, deepy.py's) arrive within this of each other.
SAME_REQUEST_SECONDS = 2.0
# How long a rank held by the hold_after_iteration fault point (megatron/runtime/faults.py) waits for a stop signal.
HELD_AFTER_ITERATION_SECONDS = 300.0


class StopRequests:
    """Counts stop requests from stop signals, copies of one request counted once."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.count = 0
        self._first_at = 0.0

    def add(self, signum: int) -> bool:
        """Count `signum`; False when it is a copy of the first request."""
        now = time.monotonic()
        if self.count == 1 and now - self._first_at < SAME_REQUEST_SECONDS:
            return False
        if self.count == 0:
            self.first, self._first_at = signum, now
        self.count += 1
        return True


class StopSignals:
    """Installed on every rank before set-up; `received` is the first stop signal, if any."""

    def __init__(self) -> None:
        self.requests = StopRequests()

    @property
    def received(self) -> int | None:
        return self.requests.first

    def install(self) -> None:
        """Take the stop signals in a thread of their own; they stay blocked everywhere else.

        Blocked also in the processes this rank starts (a compiler check, a data worker), which a
        scheduler's SIGTERM to every process of the job would otherwise kill in the middle of set-up.
        deepy.py starts the ranks with them blocked already (megatron/launch/supervision.py): one sent
        while this rank was starting has waited and is taken now.
        """
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)  # what a second request ends the process by
        threading.Thread(target=self._take_signals, name="stop-signals", daemon=True).start()

    def _take_signals(self) -> None:
        while True:
            self._handle(signal.sigwaitinfo(STOP_SIGNALS).si_signo)

    def _handle(self, signum: int) -> None:
        if not self.requests.add(signum):
            return
        if self.requests.count > 1:
            # Second request: die by it now, whatever the main thread is doing (stuck in a collective, or
            # saving: `latest` keeps naming the previous checkpoint).
            _die_by(signum)
            return
        if global_rank() == 0:
            os.write(2, f"{signal.Signals(signum).name} received: stopping after this iteration with a "
                        f"checkpoint; send it again ({SAME_REQUEST_SECONDS:g} s or more later) to stop at once\n"
                        .encode())

    def hold_before_first_step(self) -> None:
        self._wait_for_a_signal(faults.seconds("hold_before_first_step"))

    def _wait_for_a_signal(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.received is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def agreed_stop(self, after_iteration: int | None = None) -> int | None:
        """The stop signal any rank received (the same answer on every rank), or None; a collective."""
        if after_iteration is not None and faults.value("hold_after_iteration") == str(after_iteration):
            self._wait_for_a_signal(HELD_AFTER_ITERATION_SECONDS)
        noted = [signum for _, signum in reported_by_ranks(self.received)]
        return max(noted) if noted else None


def _die_by(signum: int) -> None:
    """End this process by `signum` (its default action), whatever the main thread is doing."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    signal.pthread_kill(threading.get_ident(), signum)


def _kill_child_processes() -> list:
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    return children


def end_child_processes() -> None:
    """Kill the processes this rank started through multiprocessing (data-loader workers) and wait for them.

    They inherited the blocked stop signals (StopSignals.install), so the SIGTERM that multiprocessing sends
    its children when the interpreter exits is never taken, and the exit then waits for them for ever: a rank
    that raised while its data loaders were running never ended, nor did the run.
    """
    # torch's handler would report the killed workers as a data-loader failure, over the rank's own error
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in _kill_child_processes():
        child.join()


def hold_before_save() -> None:
    seconds = faults.seconds("hold_before_stop_save")
    if seconds > 0:
        time.sleep(seconds)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
