"""The checkpoint engine an asynchronous save writes through (async_save.py): it keeps a host copy of each
state DeepSpeed hands it instead of writing it, so training may go on while a thread writes the copies.
Apart from async_save.py because it subclasses DeepSpeed's CheckpointEngine: importing the checkpoint
package must not import DeepSpeed.

The host memory a save copied into is kept, once written, for the next save, which takes the buffers of
its sizes and frees the rest. Copying into memory that is already mapped is what keeps the pause short:
a fresh buffer costs a page fault per page (pinning it, on a GPU, far more); 1472 MiB were copied here
in 150 ms into kept buffers against 560 ms into fresh ones. The price is host memory as large as the
rank's share of a checkpoint, held from the first save to the end of the run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine


class SnapshotCheckpointEngine(CheckpointEngine):
    """Takes the place of the engine's checkpoint engine (`writer`) for one save: `save` keeps a host copy."""

    def __init__(self, writer: CheckpointEngine):
        super().__init__()
        self.name = f"snapshot for {writer.name}"
        self.writer = writer
        self.files: list[tuple[Path, Any]] = []
        self.after_files: list[Callable[[], None]] = []  # writes that follow the state files
        self._spares = dict(_kept_buffers)  # the previous save's buffers, to take from
        _kept_buffers.clear()
        self._buffers: _Buffers = {}  # this save's, kept for the next once written

    def deferred(self, write: Callable[..., None]) -> Callable[..., None]:
        """`write` made to run in the background once the state files are written."""
        return lambda *args, **kwargs: self.after_files.append(lambda: write(*args, **kwargs))

    def save(self, state_dict, path: str):
        self.files.append((Path(path), host_copy(state_dict, self._host_buffer)))

    def _host_buffer(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        spares = self._spares.get((nbytes, pinned))
        if spares:
            buffer = spares.pop()
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        self._buffers.setdefault((nbytes, pinned), []).append(buffer)
        return buffer

    def copied(self) -> None:
        """The save has handed over every state: the previous save's buffers it did not take are freed."""
        self._spares.clear()

    def keep_buffers_for_next_save(self) -> None:
        """Once the files are written (or failed): this save's host buffers go to the next save."""
        self.files.clear()
        _kept_buffers.clear()
        _kept_buffers.update(self._buffers)
        self._buffers = {}

    def add(self, path: Path, state) -> None:
        """A state that is already this save's own (no copy taken), written with the others."""
        self.files.append((Path(path), state))

    def state_of(self, path: Path):
        return next(state for saved, state in self.files if saved == Path(path))

    def create(self, *args, **kwargs):
        return self.writer.create(*args, **kwargs)

    def commit(self, *args, **kwargs):
        return self.writer.commit(*args, **kwargs)

    def makedirs(self, path, exist_ok=False):
        self.writer.makedirs(path, exist_ok=exist_ok)

    def load(self, path: str, map_location=None):
        return self.writer.load(path, map_location=map_location)

    def is_data_parallel_writer(self, dp_rank):
        return self.writer.is_data_parallel_writer(dp_rank)

    def preserves_storage_sharing(self):
        return self.writer.preserves_storage_sharing()


_Buffers = dict[tuple[int, bool], list[torch.UntypedStorage]]  # (bytes, pinned) -> host buffers of that size
_kept_buffers: _Buffers = {}  # the last asynchronous save's, written


def host_copy(value: Any, host_buffer: Callable[[int, bool], torch.UntypedStorage]) -> Any:
    """A copy of `value` that training may not change: every tensor copied to host memory (a storage of
    `host_buffer(nbytes, pinned)`, pinned where CUDA runs), dicts, lists and tuples rebuilt around them,
    everything else deep-copied. What the original shares stays shared (an object held twice, tensors
    viewing one storage), so torch.save writes the copy exactly as it would the original."""
    memo: dict[int, Any] = {}
    storages: dict[tuple[str, int], torch.UntypedStorage] = {}
    copied = _copy(value, memo, storages, host_buffer)
    if any(not device.startswith("cpu") for device, _ in storages):
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()  # the non-blocking copies from the accelerator are done
    return copied


def _copy(value: Any, memo: dict, storages: dict, host_buffer) -> Any:
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        copied = _tensor_copy(value.detach(), storages, host_buffer)
        if isinstance(value, torch.nn.Parameter):
            copied = torch.nn.Parameter(copied, requires_grad=value.requires_grad)
        else:
            copied.requires_grad_(value.requires_grad)  # saved with the tensor
        for name, attribute in vars(value).items():  # saved too (ZeRO-3 tags its partitions with ds_id)
            setattr(copied, name, _copy(attribute, memo, storages, host_buffer))
    elif isinstance(value, dict):
        copied = copy.copy(value)  # keeps the type (OrderedDict, defaultdict) and its attributes
        for key, item in value.items():
            copied[key] = _copy(item, memo, storages, host_buffer)
    elif isinstance(value, list):
        copied = type(value)(_copy(item, memo, storages, host_buffer) for item in value)
    elif isinstance(value, tuple):
        items = [_copy(item, memo, storages, host_buffer) for item in value]
        copied = type(value)._make(items) if hasattr(type(value), "_make") else type(value)(items)
    else:
        return copy.deepcopy(value, memo)  # a record a step may change (fp16's loss scaler); numbers, strings
    memo[id(value)] = copied
    return copied


def _tensor_copy(tensor: torch.Tensor, storages: dict, host_buffer) -> torch.Tensor:
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return tensor.to("cpu", copy=True)
    key = (str(storage.device), storage.data_ptr())
    host = storages.get(key)
    if host is None:
        pinned = storage.device.type != "cpu"
        host = host_buffer(storage.nbytes(), pinned)
        host.copy_(storage, non_blocking=pinned)
        storages[key] = host
    return torch.empty(0, dtype=tensor.dtype).set_(host, tensor.storage_offset(), tensor.size(), tensor.stride())


@contextmanager
def snapshot_engine(engine, snapshot: SnapshotCheckpointEngine | None) -> Iterator[None]:
    """`snapshot` as the engine's checkpoint engine for the save inside; nothing changes without one."""
    if snapshot is None:
        yield
        return
    engine.checkpoint_engine = snapshot
    try:
        yield
    finally:
        engine.checkpoint_engine = snapshot.writer
