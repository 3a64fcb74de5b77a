"""How a rank ends on an error the user can fix: one line and exit status 1, no traceback.

Expected errors are our own (megatron.errors.ExpectedError) plus a few from torch that have a known
cause: out of memory, the rendezvous port taken, a peer rank gone. Anything else is a bug and
keeps its traceback.

A failing rank ends at once, and DeepSpeed's launcher then ends the others (megatron/runtime/stop_signals.py).
Under deepy.py on one machine the ranks do not print their line: they hand it to deepy.py through the
file RANK_ERRORS_FILE names, and deepy.py prints the first one as its last line once every rank has
ended. The first is the cause: a rank hands its line over before it exits, and only its exit makes the
others fail ("lost the connection"). Several ranks failing the same way give one line, and nothing the
other ranks print while they end comes after it. Without deepy.py each rank prints its own line.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from megatron.errors import ExpectedError
from megatron.processes import skip_collection_at_exit
from megatron.ranks import global_rank
from megatron.runtime.stop_signals import end_child_processes

EXIT_EXPECTED_ERROR = 1
# Set by deepy.py (megatron/launch/supervision.py) for the ranks of this machine: the file they hand their errors to.
RANK_ERRORS_FILE = "NEOX_RANK_ERRORS_FILE"

# what torch.utils.data puts in the message of an error it re-raises from a data-loader worker
_WORKER_TRACEBACK = "Original Traceback (most recent call last):"
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


def _message(error: ExpectedError) -> str:
    """The error's own message, also when torch's DataLoader re-raised it from a worker process: that copy's
    message is the worker's whole traceback, which ends with the original error's type and message."""
    text = str(error)
    if _WORKER_TRACEBACK in text:
        text = text.rpartition(f"{type(error).__qualname__}: ")[2]
    return " ".join(text.rstrip("\n").split("\n"))


def expected_error_line(error: BaseException) -> str | None:
    """The one line that reports `error`, or None when it is a bug that keeps its traceback."""
    import torch.distributed as dist

    if isinstance(error, ExpectedError):
        return _message(error)
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


def _hand_over(line: str | None) -> bool:
    """Hand deepy.py this rank's error line (None: a bug, whose traceback the rank prints); False without deepy.py."""
    path = os.environ.get(RANK_ERRORS_FILE)
    if not path:
        return False
    record = json.dumps({"rank": global_rank(), "line": line}) + "\n"
    # one write to a file opened for appending: the records of several ranks never interleave
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(descriptor, record.encode())
    finally:
        os.close(descriptor)
    return True


def _as_printed(rank: int, line: str) -> str:
    return f"{'error' if rank == 0 else f'error on rank {rank}'}: {line}"


def first_rank_error(path: Path) -> str | None:
    """What deepy.py prints last for the records in `path`: the first error, in rank 0's words when rank 0 had
    it too; None when there is none or the first was a bug (its traceback is the report)."""
    records = [json.loads(text) for text in path.read_text().splitlines()]
    if not records or records[0]["line"] is None:
        return None
    line = records[0]["line"]
    rank = min(record["rank"] for record in records if record["line"] == line)
    return _as_printed(rank, line)


def _report(line: str) -> None:
    if not _hand_over(line):
        # one write: print() writes the text and its newline apart, and another rank's line can land between them
        sys.stderr.write(_as_printed(global_rank(), line) + "\n")
        sys.stderr.flush()


def run_rank(main: Callable[[], object]) -> int:
    """Run a rank's `main`: 0 when it returns, EXIT_EXPECTED_ERROR after reporting an expected error."""
    try:
        main()
    except Exception as error:
        end_child_processes()  # else the rank's exit waits for them for ever
        line = expected_error_line(error)
        if line is None:
            _hand_over(None)
            raise
        _report(line)
        return EXIT_EXPECTED_ERROR
    # DeepSpeed's pipe engine keeps the last data iterator it was given, so its data-loader workers outlive
    # `main` and would hold up the exit as above
    end_child_processes()
    from megatron.runtime.initialize import leave_process_group

    leave_process_group()
    return 0


def exit_after_rank(main: Callable[[], object]) -> NoReturn:
    """A rank process's last act: run its `main` (run_rank) and exit with the status, without the interpreter's
    last garbage collection (megatron.processes.skip_collection_at_exit)."""
    status = run_rank(main)
    skip_collection_at_exit()
    sys.exit(status)
