"""How a rank ends on an error the user can fix: one line on stderr and exit status 1, no traceback.

Expected errors are our own (megatron.errors.ExpectedError) plus a few from torch that have a known
cause: out of memory, the rendezvous port taken, a peer rank gone. Anything else is a bug and
keeps its traceback.

Rank 0 speaks at once. The other ranks usually fail the same way and are stopped by DeepSpeed's
launcher within a second or two of rank 0's exit, so they stay quiet for a while first (ranks can
reach the same point many seconds apart on a busy machine): only an error rank 0 did not have (a
shard only another rank reads) reaches the user from them, late.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from megatron.errors import ExpectedError
from megatron.ranks import global_rank
from megatron.stop_signals import end_child_processes

EXIT_EXPECTED_ERROR = 1
# How long a rank other than 0 stays quiet before reporting its error (DeepSpeed's launcher polls
# its ranks once a second and stops the others when one exits with an error).
OTHER_RANKS_QUIET_SECONDS = 30.0

_OUT_OF_MEMORY_HINT = ("lower train_micro_batch_size_per_gpu (raise gradient_accumulation_steps to keep the batch), "
                       "use a higher ZeRO stage, a shorter seq_length, or more ranks")


def _is_out_of_memory(error: BaseException) -> bool:
    import torch

    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and (
        "can't allocate memory" in str(error) or "out of memory" in str(error).lower())


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def expected_error_line(error: BaseException) -> str | None:
    """The one line that reports `error`, or None when it is a bug that keeps its traceback."""
    import torch.distributed as dist

    if isinstance(error, ExpectedError):
        return " ".join(str(error).split("\n"))
    if _is_out_of_memory(error):
        return f"out of memory ({_first_line(error)}); {_OUT_OF_MEMORY_HINT}"
    if isinstance(error, dist.DistNetworkError) and "EADDRINUSE" in str(error):
        port = os.environ.get("MASTER_PORT", "?")
        return (f"master_port {port} is already in use (another run on this machine?); set another master_port, "
                "or leave master_port unset on a single node and deepy.py picks a free one")
    if isinstance(error, RuntimeError) and any(
            phrase in str(error) for phrase in ("Connection closed by peer", "Connection reset by peer")):
        return "lost the connection to another rank, which failed or was stopped (its message says why)"
    return None


def _report(line: str, stop_requested: Callable[[], bool]) -> None:
    rank = global_rank()
    if rank != 0:
        quiet_until = time.monotonic() + OTHER_RANKS_QUIET_SECONDS
        while not stop_requested() and time.monotonic() < quiet_until:
            time.sleep(0.1)
        if stop_requested():
            return  # the launcher stopped this rank because another one failed, which has said why
    prefix = "error" if rank == 0 else f"error on rank {rank}"
    # one write: print() writes the text and its newline apart, and another rank's line can land between them
    sys.stderr.write(f"{prefix}: {line}\n")
    sys.stderr.flush()


def run_rank(main: Callable[[], object], stop_requested: Callable[[], bool] = lambda: False) -> int:
    """Run a rank's `main`: 0 when it returns, EXIT_EXPECTED_ERROR after reporting an expected error."""
    try:
        main()
    except Exception as error:
        end_child_processes()  # else the rank's exit waits for them for ever
        line = expected_error_line(error)
        if line is None:
            raise
        _report(line, stop_requested)
        return EXIT_EXPECTED_ERROR
    from megatron.initialize import leave_process_group

    leave_process_group()
    return 0
