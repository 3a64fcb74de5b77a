"""Writing a tag so that it is complete or never offered for loading, and the checks on the save directory.

A save writes every file into ``<tag>.partial``; then each file is fsynced and recorded in the tag's
manifest, the folder is renamed to ``<tag>`` and only then ``latest`` moves. A save killed or failed
at any moment leaves the previous tag and ``latest`` as they were; the partial folder is never
listed as a tag and is removed by the next save.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import layout, manifest
from megatron.fsio import fsync_path, replace_dir
from megatron.ranks import rank_and_world
from megatron.runtime import faults
from megatron.runtime.collective import all_gather, barrier, decided_by_rank_zero, reported_by_ranks

_PROBE_PREFIX = ".write_probe"


def tree_size(path: Path) -> int:
    return sum(child.stat().st_size for child in Path(path).rglob("*") if child.is_file())


def newest_tag_size(save_dir: Path) -> tuple[str, int] | None:
    """(tag, bytes) of the newest tag under `save_dir`: what one more save will take."""
    tags = list(layout.list_tags(save_dir))
    if not tags:
        return None
    return tags[-1], tree_size(Path(save_dir) / tags[-1])


def _size(count: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_room_and_access(save_dir: str | Path, rank: int = 0) -> None:
    """Before the first step: `save_dir` exists or can be created, is a writable directory, and has room for one more tag.

    The room needed is judged by the size of the newest tag already there (none: not judged).
    """
    save_dir = Path(save_dir).expanduser()
    where = f"`save: {save_dir}`"
    if save_dir.exists() and not save_dir.is_dir():
        raise CheckpointError(f"{where} is a file, not a directory; point `save` at a directory.")
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(
            f"{where} cannot be created ({err.strerror or err}); fix the path or its permissions."
        ) from err
    newest = newest_tag_size(save_dir)
    if newest is not None:
        tag, need = newest
        free = _free_bytes(save_dir)
        if free < need:
            raise CheckpointError(
                f"{where} has {_size(free)} free, but one more checkpoint needs about {_size(need)} (the size of "
                f"{tag}); free space there or point `save` at a directory with room."
            )
    try:
        probe = save_dir / f"{_PROBE_PREFIX}.{os.getpid()}.{rank}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as err:
        raise CheckpointError(
            f"{where} cannot be written ({err.strerror or err}); fix its permissions, free space there, or point "
            "`save` at a writable directory."
        ) from err


def start_tag(save_dir: Path, tag: str) -> Path:
    """Rank 0, before a save: remove interrupted saves, check the room, create ``<tag>.partial``."""
    save_dir.mkdir(parents=True, exist_ok=True)
    for leftover in layout.list_partial_tags(save_dir):
        shutil.rmtree(save_dir / leftover, ignore_errors=True)
    check_room_and_access(save_dir)
    partial = save_dir / layout.partial_tag(tag)
    partial.mkdir()
    return partial


def start_writing(save_dir: Path, tag: str) -> Path:
    """Collective: rank 0 starts ``<tag>.partial`` (start_tag), and every rank gets its path once it exists."""
    if rank_and_world()[0] == 0:
        start_tag(save_dir, tag)
    barrier()
    return save_dir / layout.partial_tag(tag)


def write_tag(save_dir: Path, tag: str, iteration: int, write_files: Callable[[Path], WriteFailure | None],
              committed: Callable[[], None] = lambda: None) -> Path:
    """A blocking save of any writer (a run's engine, a converter, a bench): collective. Every rank writes its
    files of `tag` with ``write_files(partial folder)``, which returns its failed write or None; once all are
    on disk each records its share and the one commit runs (commit_tag). The tag's path, or the one-line
    CheckpointError every rank raises."""
    save_dir = Path(save_dir)
    partial = start_writing(save_dir, tag)
    failure = write_files(partial)
    barrier()  # every rank's files are on disk before any rank lists them
    failure, records = record_this_ranks_share(partial, failure)
    problem = commit_tag(save_dir, tag, iteration, failure, records, committed)
    if problem:
        raise CheckpointError(problem)
    return save_dir / tag


def record_this_ranks_share(partial: Path, failure: WriteFailure | None
                            ) -> tuple[WriteFailure | None, dict[str, manifest.FileRecord]]:
    """Once every rank's files of a blocking save are on disk: this rank's share of them (every world-th file
    of the folder), fsynced and checksummed; nothing after a failed write. A file that cannot be read
    back is this rank's failure, so that every rank still reaches the commit's one gather."""
    if failure is not None:
        return failure, {}
    rank, world = rank_and_world()
    path = None
    try:
        records = {}
        for name in manifest.tag_file_names(partial)[rank::world]:
            path = partial / name
            records[name] = manifest.record_file(path)
        return None, records
    except OSError as err:
        return WriteFailure(path, err), {}


def commit_tag(save_dir: Path, tag: str, iteration: int, failure: WriteFailure | None,
               records: dict[str, manifest.FileRecord], committed: Callable[[], None], group=None) -> str | None:
    """The one way a tag is committed, for a blocking save and a background one alike. Collective (over
    `group`), once each rank has written its files of the tag into ``<tag>.partial`` and recorded them
    (`records`), or failed (`failure`).

    One gather of every rank's failure line and records; global rank 0 decides: on a failure anywhere it
    discards the partial folder; else it records the files no rank recorded (its own small ones: configs),
    writes the manifest, renames the folder to ``<tag>``, moves ``latest`` and runs `committed`. Every rank
    returns rank 0's outcome: None once committed, else the one line every rank raises."""
    exchanged = all_gather((failure_line(save_dir, tag, failure), records), group)
    faults.kill_point("files_written", iteration)
    outcome = None
    if rank_and_world()[0] == 0:
        outcome = first_failure([(rank, line) for rank, (line, _) in enumerate(exchanged) if line])
        if outcome is None:
            outcome = _publish(save_dir, tag, iteration, [part for _, part in exchanged], committed)
        if outcome is not None:
            discard_partial(save_dir, tag)
    return decided_by_rank_zero(outcome, group)


def _publish(save_dir: Path, tag: str, iteration: int, parts: list[dict[str, manifest.FileRecord]],
             committed: Callable[[], None]) -> str | None:
    """Rank 0: the manifest, the rename, `latest`, then `committed`; the one-line failure, if any."""
    partial, final = save_dir / layout.partial_tag(tag), save_dir / tag
    records = {name: record for part in parts for name, record in part.items()}
    try:
        for name in manifest.tag_file_names(partial):
            if name not in records:
                records[name] = manifest.record_file(partial / name)
        manifest.write_manifest(partial, records)
        for folder in {(partial / name).parent for name in records}:
            fsync_path(folder)
        faults.kill_point("manifest_written", iteration)
        replace_dir(partial, final)
        faults.kill_point("renamed", iteration)
        layout.write_latest(save_dir, tag)
    except Exception as err:
        return first_failure([(0, failure_line(save_dir, tag, WriteFailure(None, err)))])
    committed()
    return None


def is_write_error(err: BaseException) -> bool:
    """An error writing a file: an OSError, or torch's zip writer's RuntimeError (it reports a full disk
    or a file-size limit without an errno)."""
    return isinstance(err, OSError) or (isinstance(err, RuntimeError) and "inline_container" in str(err))


@dataclass
class WriteFailure:
    """A write of one rank that failed, kept until every rank has left the save's collectives."""

    path: Path
    error: BaseException


def stop_if_any_rank_failed(save_dir: Path, tag: str, failure: WriteFailure | None) -> None:
    """Collective, once every rank's writes of `tag` are done: when any rank's write failed, every rank
    raises the same one-line error (the first failed rank's), so none waits for another in a later collective."""
    failed = first_failure(reported_by_ranks(failure_line(save_dir, tag, failure)))
    if failed:
        raise CheckpointError(failed)


def failure_line(save_dir: Path, tag: str, failure: WriteFailure | None) -> str | None:
    """The one line for this rank's failed write of `tag`; also for an error that is no write failure
    (a bug), so that the other ranks hear of it rather than wait."""
    if failure is None:
        return None
    known = save_failed(save_dir, tag, failure.error, failure.path)
    return str(known) if known else f"saving {tag} failed: {type(failure.error).__name__}: {failure.error}"


def first_failure(failed: list[tuple[int, str]]) -> str | None:
    """The line every rank raises for the (rank, line) failures reported_by_ranks gathered."""
    if not failed:
        return None
    rank, text = failed[0]
    return f"rank {rank}: {text}" if rank_and_world()[1] > 1 else text


def _file_size_limit() -> int | None:
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def save_failed(save_dir: Path, tag: str, err: BaseException, path: Path | None = None) -> CheckpointError | None:
    """The one-line error for a failed write of `tag` (of the file `path`, where known); None when `err` is
    no write failure (a bug)."""
    if not is_write_error(err):
        return None
    partial = save_dir / layout.partial_tag(tag)
    written = tree_size(partial) if partial.is_dir() else 0
    try:
        previous = layout.read_latest(save_dir)
    except CheckpointError:
        previous = None
    kept = f"{save_dir / previous} is intact" if previous else "no earlier checkpoint was there"
    try:
        free = _free_bytes(save_dir)
    except OSError:
        free = None
    newest = newest_tag_size(save_dir)
    need = newest[1] if newest else None
    limit = _file_size_limit()
    if limit is not None and (getattr(err, "errno", None) == errno.EFBIG or (
            path is not None and path.is_file() and path.stat().st_size >= limit)):
        needed = f"about {_size(need)} (the size of {newest[0]})" if need else "more"
        file = f"{path.name} of {tag}" if path is not None else tag
        return CheckpointError(
            f"cannot write {file} in {save_dir}: this process may write files of at most {_size(limit)} (its "
            f"file-size limit, `ulimit -f`), the checkpoint needs {needed}. The run stopped; {kept}. Raise the "
            "limit (`ulimit -f unlimited` before starting), then run again."
        )
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
        free is not None and free < max((need or 0) - written, 1 << 20))
    if full:
        needed = (f"about {_size(need)} (the size of {newest[0]})" if need
                  else f"more than the {_size(written)} written before the disk filled")
        return CheckpointError(
            f"no space left in {save_dir} while saving {tag}: it needs {needed}, {_size(free or 0)} are free. "
            f"The run stopped; {kept}. Free space there or point `save` at a directory with room, then run again."
        )
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return CheckpointError(
        f"cannot write checkpoint {tag} in {save_dir}: {reason}. The run stopped; {kept}. "
        "Fix the directory (permissions, mount) or point `save` elsewhere, then run again."
    )


def discard_partial(save_dir: Path, tag: str) -> None:
    shutil.rmtree(save_dir / layout.partial_tag(tag), ignore_errors=True)
