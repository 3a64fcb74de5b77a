"""Processes of this machine: facts about others, read from Linux's /proc, and how ours end."""

from __future__ import annotations

import gc
from pathlib import Path


def process_start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot; None when unknown or gone. With the pid it names
    one process for good: a pid reused by a later process comes with another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces; start time is field 22
    return int(stat[stat.rindex(")") + 2:].split()[19])


def skip_collection_at_exit() -> None:
    """Spare a process that is about to end the interpreter's last garbage collection, which walks every
    object torch, DeepSpeed and transformers created (about 2 s of a run's end on two cores) only to hand
    memory back that the exit returns anyway. Call it once the process's own work is closed: files written
    and closed, checkpoints committed: objects in reference cycles are then left to the exit, not finalized."""
    gc.freeze()
