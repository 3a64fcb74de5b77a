"""SIGTERM/SIGINT on a rank: the first one stops the run after the current step (with a checkpoint),
a second one stops the process at once.

Schedulers send SIGTERM some time before they kill a job; deepy.py forwards it (and Ctrl-C's
SIGINT) to every rank. A rank only notes the signal; the training loop asks `agreed_stop()` once
per step, which all-reduces the note, so every rank stops after the same step even when the
signal reached them during different steps.
"""

from __future__ import annotations

import os
import signal
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Test-only: seconds a rank waits between agreeing to stop and saving, so a test can deliver the
# second signal before the save starts.
HOLD_BEFORE_SAVE_ENV = "NEOX_TEST_HOLD_BEFORE_STOP_SAVE"


class StopSignals:
    """Installed on every rank before set-up; `received` is the first stop signal, if any."""

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            # Second signal: die by it now, whatever the rank is doing (a save in progress leaves
            # `latest` naming the previous checkpoint).
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        if os.environ.get("RANK", "0") == "0":
            # os.write, not logging: a handler may interrupt the main thread inside a logging call.
            os.write(2, f"{signal.Signals(signum).name} received: stopping after this iteration with a "
                        "checkpoint; send it again to stop at once\n".encode())

    def agreed_stop(self, device) -> int | None:
        """The stop signal any rank received (the same answer on every rank), or None; a collective."""
        import torch
        import torch.distributed as dist

        noted = self.received or 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([noted], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            noted = int(flag.item())
        return noted or None


def hold_before_save() -> None:
    seconds = float(os.environ.get(HOLD_BEFORE_SAVE_ENV, "0") or 0)
    if seconds > 0:
        time.sleep(seconds)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
