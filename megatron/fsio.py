"""Durable writes: a file is either wholly there under its final name, or not there at all.

A rename is atomic but not durable by itself: after a power loss the new name may point at a file
whose data never reached the disk. So the data is fsynced before the rename and the directory
holding the name after it.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` for a temporary file next to ``path``, then make it ``path`` durably.

    A reader sees the old file or the new one, never a half-written one; the temporary file is
    removed when ``write`` fails.
    """
    with replaced_on_success([path]) as (tmp,):
        write(tmp)


@contextmanager
def replaced_on_success(paths: Sequence[str | Path]) -> Iterator[list[Path]]:
    """Temporary files next to each of ``paths`` for the block to write; when it completes they become
    ``paths`` durably, else they are removed and ``paths`` are as they were.

    Each file is replaced atomically, one after the other, and only once the block has written them all.
    """
    paths = [Path(path) for path in paths]
    temporaries: list[Path] = []
    try:
        for path in paths:
            temporaries.append(Path(_create_temporary_file(path)))
        yield temporaries
        for tmp in temporaries:
            fsync_path(tmp)
        for tmp, path in zip(temporaries, paths, strict=True):
            os.replace(tmp, path)
    except BaseException:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)
        raise
    for folder in dict.fromkeys(path.parent for path in paths):
        fsync_path(folder)


def _create_temporary_file(path: Path) -> str:
    """A new empty file next to `path` with the permissions the umask gives any plain file (mkstemp's are 0600)."""
    while True:
        tmp = str(path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def write_text_atomically(path: str | Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text))


_RENAME_EXCHANGE = 2  # renameat2 flag (Linux): swap two existing names in one step


def replace_dir(src: str | Path, dst: str | Path) -> None:
    """Make the directory `src` take the name `dst`, durably; an existing `dst` is replaced and removed.

    Where the OS can swap two names atomically (Linux renameat2), `dst` names the old or the new
    directory at every moment; elsewhere it is briefly absent while the old one is moved aside.
    """
    import shutil

    src, dst = Path(src), Path(dst)
    if not dst.exists():
        os.rename(src, dst)
    else:
        if not _exchange(src, dst):
            aside = dst.with_name(dst.name + ".replaced")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(dst, aside)
            os.rename(src, dst)
            src = aside
        fsync_path(dst.parent)
        shutil.rmtree(src)
    fsync_path(dst.parent)


def _exchange(a: Path, b: Path) -> bool:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # the filesystem or kernel cannot swap names
    raise OSError(err, os.strerror(err), str(a), None, str(b))
