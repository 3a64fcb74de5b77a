"""Memory readings of the current process from Linux /proc.

Peak RSS is measured by resetting the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``),
running the code, then reading ``VmHWM``; where that reset is refused, ``ru_maxrss`` is the fallback,
which only shows growth beyond the process's earlier peak (a lower bound, said in the output).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

MIB = 1024 * 1024
T = TypeVar("T")


def status_kib(field: str) -> int:
    """A ``kB`` line of /proc/self/status, e.g. ``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"/proc/self/status has no {field} line (not Linux?)")


def smaps_rollup_kib() -> dict[str, int] | None:
    """/proc/self/smaps_rollup as {field: kB} (Rss, Pss, Anonymous, ...); None where the kernel lacks it."""
    path = Path("/proc/self/smaps_rollup")
    if not path.exists():
        return None
    values = {}
    for line in path.read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            values[parts[0][:-1]] = int(parts[1])
    return values


def mapped_file_kib(path: Path) -> dict[str, int]:
    """Rss and Pss (kB) of this process's mappings of the file at ``path``, from /proc/self/smaps.

    Unlike whole-process figures these do not move when other processes map the same shared
    libraries, so they isolate what the mapped file itself costs.
    """
    target = str(Path(path).resolve())
    totals = {"Rss": 0, "Pss": 0}
    in_target = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if parts and not parts[0].endswith(":"):  # a mapping's header: address perms offset dev inode [path]
            in_target = len(parts) >= 6 and " ".join(parts[5:]) == target
        elif in_target and parts and parts[0][:-1] in totals:
            totals[parts[0][:-1]] += int(parts[1])
    return totals


def return_freed_memory_to_os(threshold_bytes: int = 128 * 1024) -> bool:
    """Make glibc serve every allocation above ``threshold_bytes`` by its own mmap, unmapped when freed.

    By default glibc raises that threshold after large frees (up to 32 MiB) and then keeps freed
    tensors in its heap, so a second load reuses them and shows no RSS growth at all. A fixed
    threshold turns that adjustment off; peak RSS then shows what each call allocates. False where
    the C library has no ``mallopt`` (not glibc).
    """
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    m_mmap_threshold = -3  # from glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, threshold_bytes))


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class MemoryDelta:
    peak_growth_mib: float  # peak RSS during the call minus RSS before it
    retained_mib: float  # RSS after the call minus RSS before it
    exact_peak: bool  # False: ru_maxrss fallback, the peak growth is a lower bound


def measure_memory(call: Callable[[], T]) -> tuple[T, MemoryDelta]:
    """Run ``call`` once and report how much RSS it needed at its peak and kept afterwards."""
    before = status_kib("VmRSS")
    exact = _reset_peak_rss()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = call()
    after = status_kib("VmRSS")
    if exact:
        peak = status_kib("VmHWM")
    else:
        peak = max(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, maxrss_before)
    return result, MemoryDelta((peak - before) / 1024, (after - before) / 1024, exact)


class PeakSampler:
    """Samples fields of this process's smaps_rollup on a thread while a call runs; reports peak growth.

    The default fields: Private = Private_Clean + Private_Dirty, pages no other process maps
    (anonymous memory, and file pages only this process touched), and Pss, where pages of a file that
    several ranks map are shared and split between them. ``Anonymous`` counts only memory the process
    allocated itself, leaving out every page of a memory-mapped file (those are the page cache's).
    Growth is reported against the reading before the call.
    """

    def __init__(self, interval_s: float = 0.002, fields: tuple[str, ...] = ("Private", "Pss")):
        self.interval_s = interval_s
        self.fields = fields

    def _read(self) -> list[int]:
        values = smaps_rollup_kib() or {}
        values["Private"] = values.get("Private_Clean", 0) + values.get("Private_Dirty", 0)
        return [values.get(field, 0) for field in self.fields]

    def measure(self, call: Callable[[], T]) -> tuple[T, float, ...]:
        """(result, peak growth in MiB of each field)."""
        import threading

        before = self._read()
        peaks = list(before)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peaks[:] = map(max, peaks, self._read())
                done.wait(self.interval_s)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            result = call()
        finally:
            done.set()
            thread.join()
        peaks[:] = map(max, peaks, self._read())
        return (result, *((peak - start) / 1024 for peak, start in zip(peaks, before, strict=True)))
