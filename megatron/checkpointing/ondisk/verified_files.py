"""Which checkpoint files were checked against their tag's manifest, so each is checked once per node.

The load plan and the module read that follows it read the same model-states file, and every rank of
a node reads the same files of a tag; the checksum pass is a full read of the file. The first rank of a
launch on this node to read a file checks it; the others wait for that check (an exclusive lock on the
file's key) and take its result from a marker, a file in a folder under the temporary directory that
only this user can write, named by the launch (the process that started the ranks, by id and start
time). Each process's first check removes the folders of this user's launches that ended. A rank run
on its own (no launcher process of its kind, or no /proc) remembers its checks for itself only.

A file is known by its identity and state (device, inode, size, modification and change time) and by
the state of its manifest, so a replaced, rewritten or touched file, or a changed manifest, is checked
again. A failed check writes no marker: every rank that reads a damaged file finds the damage itself.

Inside checks_beside_use() a check runs in a thread while the caller unpickles and copies the file it
checks: both read the same pages, so a cold file comes from the disk once, and the check's wait on the
disk overlaps the copies. Leaving the block waits for every check begun in it and raises the first
problem, so weights read inside it are used only inside it (a load, before its first training step).
Asked for a file's problem inside the block (a full resume's check of every file it reads), the check
begun beside the file's read answers, rather than a second pass over the file.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import layout, manifest
from megatron.processes import process_start_time

_checked_here: set[tuple] = set()
_beside_use: dict[tuple, Future] | None = None  # the checks begun inside checks_beside_use(), by file key
_beside_use_thread: ThreadPoolExecutor | None = None
_MARKER_DIR_PREFIX = "neox-checked-files-"
_swept_ended_launches = False  # this process removed the marker folders of launches that ended


def check_open_checkpoint_file(handle, path: Path) -> None:
    """Raise CheckpointError when the file open as `handle` (read from `path`) does not match its tag's
    manifest; a tag without a manifest passes unchecked. The bytes checked are those of `handle`.
    Inside checks_beside_use() the check is begun here and its problem raised when the block ends."""
    if _beside_use is None:
        _check_now(handle, path)
        return
    key = _state_key(handle, path)
    if key not in _checked_here and key not in _beside_use:
        # The launch's folder is found and the lock file opened here, before the caller unpickles: in the thread
        # each of these calls could wait for the interpreter lock behind the unpickling (up to
        # sys.getswitchinterval(), 5 ms) while the disk stood idle (a cold 21M-parameter load: 1-6 ms).
        lock = _node_lock(key)
        _beside_use[key] = _beside_use_thread.submit(_check_duplicate, os.dup(handle.fileno()), path, key, lock)


@contextmanager
def checks_beside_use() -> Iterator[None]:
    """Check the files read inside the block in a thread beside their use; on leaving, wait for every check
    and raise the first problem, in place of any error the block raised (a damaged file explains it)."""
    global _beside_use, _beside_use_thread
    if _beside_use is not None:  # nested: the outer block waits for these checks
        yield
        return
    _beside_use, _beside_use_thread = {}, ThreadPoolExecutor(1, thread_name_prefix="checkpoint-file-check")
    try:
        yield
    finally:
        checks, thread = _beside_use, _beside_use_thread
        _beside_use = _beside_use_thread = None
        thread.shutdown(wait=True)
        problem = next(filter(None, (check.exception() for check in checks.values())), None)
        if problem is not None:
            raise problem from None


def _check_duplicate(descriptor: int, path: Path, key: tuple, lock: _NodeLock | None) -> None:
    with open(descriptor, "rb", buffering=0) as handle:
        _check_once(handle, path, key, lock)


def _check_now(handle, path: Path) -> None:
    key = _state_key(handle, path)
    if key not in _checked_here:
        _check_once(handle, path, key, _node_lock(key))


def _check_once(handle, path: Path, key: tuple, lock: _NodeLock | None) -> None:
    """Check the file unless this launch's ranks on this node did (`lock`, None for a rank on its own)."""
    if lock is None:
        _check(handle, path)
    else:
        with lock.file:
            fcntl.flock(lock.file, fcntl.LOCK_EX)  # released when the lock file closes
            if not lock.marker.exists():
                _check(handle, path)
                lock.marker.touch()
    _checked_here.add(key)


@dataclass
class _NodeLock:
    file: BinaryIO  # open, not yet locked
    marker: Path  # there once a rank of this launch on this node found the file sound


def _node_lock(key: tuple) -> _NodeLock | None:
    markers = _launch_marker_dir()
    if markers is None:
        return None
    name = hashlib.sha256(repr(key).encode()).hexdigest()
    return _NodeLock(open(markers / f"{name}.lock", "ab"), markers / name)


def checkpoint_file_problem(path: Path) -> str | None:
    """check_open_checkpoint_file for `path` as a one-line problem (None when it matches), for callers that
    gather the ranks' problems before raising."""
    try:
        with open(path, "rb", buffering=0) as handle:
            begun = None if _beside_use is None else _beside_use.get(_state_key(handle, Path(path)))
            if begun is None:
                _check_now(handle, Path(path))
            else:  # the check begun beside the file's read: its answer, not a second read of the file
                begun.result()
    except OSError as err:
        return f"cannot read checkpoint file {path}: {err.strerror or err}. Load another tag with `iteration: N`."
    except CheckpointError as err:
        return str(err)
    return None


def forget_checked_files() -> None:
    """Check every file again at its next read, as a new launch would (benchmarks repeat loads in one launch)."""
    _checked_here.clear()
    markers = _launch_marker_dir()
    if markers is not None:
        shutil.rmtree(markers, ignore_errors=True)


def _check(handle, path: Path) -> None:
    tag_dir = path.parent
    problem = manifest.check_open_file(handle, path, manifest.read_manifest(tag_dir), tag_dir)
    if problem:
        raise CheckpointError(problem)


def _state_key(handle, path: Path) -> tuple:
    def state(found: os.stat_result) -> tuple:
        return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns

    try:
        manifest_state = state(os.stat(path.parent / layout.MANIFEST_FILE))
    except FileNotFoundError:
        manifest_state = None
    return str(path), state(os.fstat(handle.fileno())), manifest_state


def _launch_marker_dir() -> Path | None:
    """This launch's marker folder on this node, made private to this user; None when the launch has no name."""
    global _swept_ended_launches
    parent = os.getppid()
    launcher_start = process_start_time(parent)
    if launcher_start is None:
        return None
    folder = Path(tempfile.gettempdir()) / f"{_MARKER_DIR_PREFIX}{os.getuid()}-{parent}-{launcher_start}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        owner = folder.lstat()
    except OSError:
        return None
    if owner.st_uid != os.getuid() or owner.st_mode & 0o077 or folder.is_symlink():
        return None  # another user's folder could claim checks that never ran
    if not _swept_ended_launches:
        _swept_ended_launches = True
        _remove_folders_of_ended_launches(folder.parent)
    return folder


def _remove_folders_of_ended_launches(temporary: Path) -> None:
    """Remove this user's marker folders whose launcher process has ended (no process of that id, or one started
    at another time), once per process: every launch leaves its folder behind, as its ranks cannot know which
    of them ends last."""
    prefix = f"{_MARKER_DIR_PREFIX}{os.getuid()}-"
    try:
        names = [entry.name for entry in os.scandir(temporary) if entry.name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid, _, start = name.removeprefix(prefix).partition("-")
        if pid.isdigit() and start.isdigit() and process_start_time(int(pid)) != int(start):
            folder = temporary / name
            try:
                found = folder.lstat()
            except OSError:
                continue
            if found.st_uid == os.getuid() and stat.S_ISDIR(found.st_mode):  # not a link another user placed
                shutil.rmtree(folder, ignore_errors=True)
