"""The manifest of a tag: size and checksum of each of its files, written last when the tag is saved.

A file is checked against it before it is read, so damage inside a file (bytes overwritten, not
only a cut-off end) is a clear error instead of a run that trains from damaged weights or states.
Tags without a manifest (GPT-NeoX's, converted ones, ours from before manifests) load unchecked.
A tag with a manifest is all or nothing: the manifest must list every file of the tag (a file it
does not list could be read unchecked), and a manifest without entries is refused like a damaged one.

Each entry names its checksum by its key: saves write XXH3-64 (manifest version 3), earlier saves
wrote CRC-32 (version 2) or SHA-256 (version 1), and all three are checked. XXH3 guards against
damage, not tampering, like CRC-32, and runs about five times as fast as zlib's CRC-32 here; the check
is part of every load, where a slower checksum adds its time to the read of every restart.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import xxhash

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import layout
from megatron.fsio import fsync_path, write_text_atomically

MANIFEST_VERSION = 3
CHECKSUM = "xxh3_64"  # what saves record
# Read and checksummed in pieces small enough to stay in the CPU's cache.
_CHUNK_BYTES = 1 << 20


class _Crc32:
    def __init__(self):
        self._value = 0

    def update(self, data) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


# manifest key -> (name in messages, running checksum)
_CHECKSUMS = {"xxh3_64": ("XXH3-64", xxhash.xxh3_64), "crc32": ("CRC-32", _Crc32),
              "sha256": ("SHA-256", hashlib.sha256)}


@dataclass(frozen=True)
class FileRecord:
    size: int
    checksum: str  # a key of _CHECKSUMS
    digest: str


def file_checksum(path: Path, checksum: str = CHECKSUM) -> str:
    """The hex digest of the file's bytes by `checksum` (a key of _CHECKSUMS)."""
    with open(path, "rb", buffering=0) as handle:
        return _open_file_checksum(handle, checksum)


def _open_file_checksum(handle, checksum: str) -> str:
    """The digest of every byte of the open file `handle`.

    Read with pread() into one reused buffer that stays in the CPU's cache, from offset 0 whatever the
    handle's position. With XXH3 the pass waits on the disk, not the CPU, and plain reads of a cold
    file came in faster here than faults on a sequential memory map (40 MiB: 25 against 31-34 ms;
    cached, 3 against 2 ms); the pages read stay in the page cache for the memory-mapped torch.load
    that follows, so the file is read from the disk once.
    """
    running = _CHECKSUMS[checksum][1]()
    buffer = bytearray(_CHUNK_BYTES)
    with memoryview(buffer) as view:
        offset = 0
        while read := os.preadv(handle.fileno(), [buffer], offset):
            running.update(view[:read])
            offset += read
    return running.hexdigest()


def tag_file_names(tag_dir: Path) -> list[str]:
    """Every file under `tag_dir` but the manifest, as sorted '/'-separated relative names."""
    tag_dir = Path(tag_dir)
    names = (path.relative_to(tag_dir).as_posix() for path in tag_dir.rglob("*") if path.is_file())
    return sorted(name for name in names if name != layout.MANIFEST_FILE)


def record_file(path: Path) -> FileRecord:
    """Flush one freshly written file to the disk and describe it for the manifest."""
    fsync_path(path)
    return FileRecord(size=path.stat().st_size, checksum=CHECKSUM, digest=file_checksum(path))


def write_manifest(tag_dir: Path, records: dict[str, FileRecord]) -> None:
    files = {name: {"size": record.size, record.checksum: record.digest} for name, record in sorted(records.items())}
    text = json.dumps({"manifest_version": MANIFEST_VERSION, "files": files}, indent=1)
    write_text_atomically(Path(tag_dir) / layout.MANIFEST_FILE, text + "\n")


_WAY_OUT = "Load another tag with `iteration: N`, or delete the manifest to load the tag unchecked."


def read_manifest(tag_dir: Path) -> dict[str, FileRecord] | None:
    """The records of `tag_dir`'s manifest; None when the tag has none.

    Refused (CheckpointError) when the manifest is damaged, lists no files, or misses a file the tag
    holds. Lists the folder, checksums nothing: cheap enough for planning a load.
    """
    path = Path(tag_dir) / layout.MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        records = _parsed_manifest(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"{path} is damaged ({type(err).__name__}: {err}), so the files of {Path(tag_dir).name} cannot be "
            f"checked. {_WAY_OUT}"
        ) from err
    if not records:
        raise CheckpointError(f"{path} lists no files (a save writes one entry per file), so the files of "
                              f"{Path(tag_dir).name} cannot be checked. {_WAY_OUT}")
    unlisted = [name for name in tag_file_names(tag_dir) if name not in records]
    if unlisted:
        shown = ", ".join(unlisted[:4]) + (f" (and {len(unlisted) - 4} more)" if len(unlisted) > 4 else "")
        raise CheckpointError(
            f"{path} does not list {shown}, which {Path(tag_dir).name} holds; a file "
            f"added after the save cannot be checked. Remove the file if it does not belong to the tag. {_WAY_OUT}"
        )
    return records


_parsed: dict[str, tuple[tuple, dict[str, FileRecord]]] = {}  # by path: (the file's state when read, its records)


def _parsed_manifest(path: Path) -> dict[str, FileRecord]:
    """The records `path` holds, parsed once per state of the file: the plan, the resume's checks and the
    check of each file it reads (verified_files) all ask; a rewritten, replaced or touched manifest is read again."""
    found = os.stat(path)
    state = (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)
    known = _parsed.get(str(path))
    if known is None or known[0] != state:
        stored = json.loads(path.read_text())
        known = state, {name: _record(name, entry) for name, entry in stored["files"].items()}
        _parsed[str(path)] = known
    return dict(known[1])


def _record(name: str, entry: dict) -> FileRecord:
    known = [checksum for checksum in _CHECKSUMS if checksum in entry]
    if not known:
        raise ValueError(f"the entry of {name} has none of the checksums {', '.join(_CHECKSUMS)}")
    return FileRecord(int(entry["size"]), known[0], str(entry[known[0]]))


def check_file(path: Path, records: dict[str, FileRecord] | None, tag_dir: Path) -> str | None:
    """The one-line problem with `path` against the manifest `records` of `tag_dir`; None when it matches.

    Without a manifest (`records` None) every file passes unchecked; with one, a file it does not list
    is a problem, as is a manifest without entries.
    """
    if records is None:
        return None
    try:
        with open(path, "rb", buffering=0) as handle:
            return check_open_file(handle, Path(path), records, tag_dir)
    except OSError as err:
        return _unreadable(path, err)


def check_open_file(handle, path: Path, records: dict[str, FileRecord] | None, tag_dir: Path) -> str | None:
    """check_file for the file open as `handle` (unbuffered, binary; opened from `path`): the bytes checked are
    those of the open file, so a reader that goes on with `handle` reads exactly what was checked."""
    if records is None:
        return None
    manifest = Path(tag_dir) / layout.MANIFEST_FILE
    if not records:
        return f"{manifest} lists no files, so {path} cannot be checked. {_WAY_OUT}"
    record = records.get(Path(path).relative_to(tag_dir).as_posix())
    if record is None:
        return f"{manifest} does not list checkpoint file {path}, so it cannot be checked before it is read. {_WAY_OUT}"
    try:
        size = os.fstat(handle.fileno()).st_size
        if size != record.size:
            return f"checkpoint file {path} has {size} bytes, but {manifest} recorded {record.size} when it was saved. {_FIX}"
        if _open_file_checksum(handle, record.checksum) != record.digest:
            return (f"checkpoint file {path} is damaged: its {_CHECKSUMS[record.checksum][0]} differs from the one "
                    f"{manifest} recorded when it was saved. {_FIX}")
    except OSError as err:
        return _unreadable(path, err)
    return None


_FIX = "Load another tag with `iteration: N`, or restore the file from a copy."


def _unreadable(path: Path, err: OSError) -> str:
    return f"cannot read checkpoint file {path}: {err.strerror or err}. {_FIX}"


def verify_files(tag_dir: Path, paths) -> None:
    """Raise CheckpointError for the first of `paths` (files of `tag_dir`) that its manifest says is damaged."""
    records = read_manifest(tag_dir)
    for path in paths:
        problem = check_file(path, records, tag_dir)
        if problem:
            raise CheckpointError(problem)
