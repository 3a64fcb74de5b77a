"""Saves that do not stop training (`async_save`): training waits while the state is copied to host
memory; a thread of each rank then writes, fsyncs, checksums and commits the tag.

    with saves_waited_for():      # train(): a run (ended, stopped by a signal, diverged) leaves no save behind
        save_checkpoint(...)      # returns once the state is copied; waits first for the save in flight
                                  # (outside such a block a save is written before it returns)
        check_save_in_flight()    # every step: a failed background save stops every rank here, in one line

DeepSpeed (0.16-0.19) writes every file of a save through ``engine.checkpoint_engine.save(state_dict,
path)``. During an asynchronous save that engine is a SnapshotCheckpointEngine: it keeps a host copy
of each state instead of writing it, the copy sharing storage where the original did, so torch.save
later writes the bytes the synchronous save writes. The thread writes the files through the engine's
own checkpoint engine, fsyncs and checksums the files it wrote, and commits the tag through
commit.commit_tag, the one commit path a blocking save runs at once, over a gloo group of its own (the
main thread's collectives go on meanwhile): global rank 0 writes the manifest, renames the folder, moves
`latest`, prunes, and every rank gets its outcome, so all of them stop, or go on, alike.

The thread runs at the lowest priority (nice 19, on Linux per thread): where training keeps every core
busy, the writer takes the time training leaves instead of a core training waits for. A training step
of 2 threads on this machine's 2 cores, in side-by-side runs, kept 0.87-0.91 of its speed while a
thread wrote 512 MiB at nice 19 against 0.53-0.61 at the default priority.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import layout, manifest
from megatron.checkpointing.saving import commit
from megatron.checkpointing.saving.commit import WriteFailure
from megatron.ranks import rank_and_world
from megatron.runtime.collective import all_gather

if TYPE_CHECKING:
    from megatron.checkpointing.saving.snapshot_engine import SnapshotCheckpointEngine


@dataclass
class _InFlight:
    tag: str
    thread: threading.Thread | None = None
    failure: str | None = None  # set by the thread: the line every rank raises; None once committed
    done: threading.Event = field(default_factory=threading.Event)


_in_flight: _InFlight | None = None
_waiters = 0  # saves_waited_for blocks open: a background save needs one to wait for it
_group = None  # the gloo group the threads seal over, made once (collectively) on the first save


def _seal_group():
    global _group
    if _group is None and rank_and_world()[1] > 1:
        import torch.distributed as dist

        _group = dist.new_group(backend="gloo")
    return _group


def start(save_dir: Path, tag: str, iteration: int, snapshot: SnapshotCheckpointEngine,
          committed: Callable[[], None]) -> None:
    """On every rank, once DeepSpeed's save went through `snapshot`: write and commit the tag in the
    background; `committed` runs on global rank 0 after `latest` moved (pruning, the save line)."""
    global _in_flight
    assert _in_flight is None, "a save is still in flight; wait_for_save_in_flight() first"
    group = _seal_group()
    snapshot.copied()
    flight = _InFlight(tag)
    flight.thread = threading.Thread(
        name=f"save {tag}", target=_write_and_commit,
        args=(flight, save_dir, tag, iteration, snapshot, committed, group))
    _in_flight = flight
    flight.thread.start()


def _write_and_commit(flight: _InFlight, save_dir: Path, tag: str, iteration: int,
                      snapshot: SnapshotCheckpointEngine, committed: Callable[[], None], group) -> None:
    _yield_to_training()
    try:
        failure, records = _write_files(save_dir / layout.partial_tag(tag), snapshot)
        flight.failure = commit.commit_tag(save_dir, tag, iteration, failure, records, committed, group)
    finally:
        snapshot.keep_buffers_for_next_save()
        flight.done.set()


def _yield_to_training() -> None:
    """This thread at nice 19 (Linux's setpriority takes a thread's id); elsewhere it keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _write_files(partial: Path, snapshot: SnapshotCheckpointEngine
                 ) -> tuple[WriteFailure | None, dict[str, manifest.FileRecord]]:
    """Write this rank's files (each host copy freed once written), then fsync and checksum them."""
    written, path = [], None
    try:
        while snapshot.files:
            path, state = snapshot.files.pop(0)
            snapshot.writer.save(state, str(path))
            del state
            written.append(path)
        for write in snapshot.after_files:
            path = None
            write()
        return None, {path.relative_to(partial).as_posix(): manifest.record_file(path) for path in written}
    except Exception as err:
        snapshot.files.clear()
        return WriteFailure(path, err), {}


def awaited() -> bool:
    """Whether a save started now would be waited for (inside saves_waited_for); save_checkpoint writes
    `async_save` saves in the background only then, and elsewhere (a tool, a test) before it returns."""
    return _waiters > 0


def save_in_flight() -> bool:
    """Whether a save started and has not been agreed done (the same answer on every rank)."""
    return _in_flight is not None


def check_save_in_flight() -> None:
    """Once a step on every rank; while a save is in flight, a collective that agrees whether it is
    done: when it failed on any rank, every rank raises the same one-line CheckpointError."""
    global _in_flight
    if _in_flight is None:
        return
    done = _in_flight.done.is_set()
    reports = all_gather((done, _in_flight.failure if done else None))
    failed = next((failure for _, failure in reports if failure), None)
    if failed or all(finished for finished, _ in reports):
        _in_flight.thread.join()
        _in_flight = None
    if failed:
        raise CheckpointError(failed)


def wait_for_save_in_flight() -> None:
    """Block until the save in flight is committed; raise its one-line failure (the same on every rank)."""
    global _in_flight
    if _in_flight is None:
        return
    flight, _in_flight = _in_flight, None
    flight.thread.join()
    if flight.failure:
        raise CheckpointError(flight.failure)


@contextmanager
def saves_waited_for() -> Iterator[None]:
    """Nothing inside ends before its save in flight is committed; when it ends by an error, a failure of
    that save is logged, the error goes on. Saves run in the background (`async_save`) only inside."""
    global _waiters
    _waiters += 1
    try:
        yield
    except BaseException:
        try:
            wait_for_save_in_flight()
        except CheckpointError as failure:
            from megatron.logging import get_logger

            get_logger().error(str(failure))
        raise
    finally:
        _waiters -= 1
    wait_for_save_in_flight()
