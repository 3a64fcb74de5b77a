"""Facts about other processes of this machine, read from Linux's /proc."""

from __future__ import annotations

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


def blocks_signal(pid: int, signum: int) -> bool:
    """Whether process `pid` (its main thread) has `signum` blocked; False when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    blocked = next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:"))
    return bool(int(blocked, 16) >> (signum - 1) & 1)
