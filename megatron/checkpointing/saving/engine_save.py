"""Save a checkpoint tag through the DeepSpeed engine, with a full module file under every ZeRO stage."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed import zero
from deepspeed.utils import safe_get_full_fp32_param

from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.ondisk.module_weights import load_checkpoint_file
from megatron.checkpointing.saving.commit import WriteFailure, is_write_error
from megatron.checkpointing.saving.snapshot_engine import SnapshotCheckpointEngine, snapshot_engine
from megatron.fsio import write_atomically
from megatron.model.zero3_partition import is_partitioned
from megatron.runtime.collective import barrier


def save_engine_checkpoint(engine, save_dir: str | Path, tag: str, client_state: dict,
                           optimizer_states: bool = True, snapshot: SnapshotCheckpointEngine | None = None,
                           frozen_weights: bool = True) -> WriteFailure | None:
    """Save tag ``tag`` under ``save_dir`` on every rank (collective); return this rank's failed write, if any.

    Without ``optimizer_states`` (``no_save_optim``) the tag holds the model-states files alone (below).
    Without ``frozen_weights`` (a LoRA run's adapter-only tag) every module in it holds only the parameters
    that train (DeepSpeed's ``exclude_frozen_parameters``) and the module's buffers.
    With a ``snapshot`` (async_save.py) the state files are not written but copied into it, to be
    written by the save's background thread.

    A write that fails (a full disk, a file-size limit) does not leave this rank halfway through the
    save while the others wait for it in the save's collectives: this rank writes nothing more, goes
    through the rest of the save, and returns the failure (commit.stop_if_any_rank_failed tells all ranks).

    What DeepSpeed 0.19.8 writes into ``<save_dir>/<tag>/`` (``bf16_`` prefixes the optimizer files
    of bf16 runs; MP is the model-parallel rank, DP the data-parallel rank):

    * ZeRO 0: ``mp_rank_<MP>_model_states.pt`` with the module in the training dtype, the client
      state, and the whole optimizer state.
    * ZeRO 1, 2: the same model-states file (module in the training dtype, no optimizer) plus one
      ``[bf16_]zero_pp_rank_<DP>_mp_rank_<MP>_optim_states.pt`` per DP rank: its fp32 master
      partition and optimizer state.
    * ZeRO 3: one ``zero_pp_rank_<DP>_mp_rank_<MP>_model_states.pt`` per DP rank whose ``module``
      holds empty placeholders, not weights, plus the optimizer files as above. This function then
      adds ``mp_rank_<MP>_model_states.pt``: DP rank 0's model-states content with ``module`` holding
      the full weights (fp32 master values; the training-dtype values of parameters without a
      master), so a module-only load needs no optimizer shard. DeepSpeed's own resume still reads
      the ``zero_pp_rank_*`` files, and ``zero_to_fp32`` reads the same shapes from either file.

    Neither ``latest`` nor a manifest is written here (megatron.checkpointing.saving.commit does that).
    """
    save_dir = Path(save_dir)
    failures: list[WriteFailure] = []
    with (snapshot_engine(engine, snapshot), _writes_recording_failures(engine, failures, snapshot),
          _optimizer_left_out(engine, not optimizer_states)):
        engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=not frozen_weights)
    if engine.zero_optimization_partition_weights():
        _write_full_module_file(engine, save_dir / tag, failures, snapshot, frozen_weights)
    return failures[0] if failures else None


@contextmanager
def _optimizer_left_out(engine, leave_out: bool) -> Iterator[None]:
    """DeepSpeed 0.19.8's save_checkpoint has no switch for a save without optimizer states. It writes the
    optimizer shards (and copies zero_to_fp32.py, which reads them) from the ranks whose
    ``save_zero_checkpoint`` it set, and without ZeRO puts ``engine.optimizer.state_dict()`` into the
    model-states file. For this save no rank is a shard writer, and without ZeRO the engine shows no
    optimizer, so the model-states file holds ``optimizer: None`` as one saved without an optimizer does."""
    if not leave_out:
        yield
        return
    writes_shards, optimizer = engine.save_zero_checkpoint, engine.optimizer
    engine.save_zero_checkpoint = False
    if not engine.zero_optimization():
        engine.optimizer = None
    try:
        yield
    finally:
        engine.save_zero_checkpoint, engine.optimizer = writes_shards, optimizer


@contextmanager
def _writes_recording_failures(engine, failures: list[WriteFailure],
                               snapshot: SnapshotCheckpointEngine | None = None) -> Iterator[None]:
    """Make DeepSpeed's writes append a failed write to `failures` instead of raising, and write nothing
    after one: ``checkpoint_engine.save`` (every state file) and ``_copy_recovery_script`` (rank 0 copies
    zero_to_fp32.py into the save directory, which would otherwise appear after a failed save; with a
    `snapshot`, the background thread copies them once this rank's files are written)."""

    def recording(write, path_of):
        def guarded(*args, **kwargs):
            if failures:
                return None
            try:
                return write(*args, **kwargs)
            except Exception as err:
                if not is_write_error(err):
                    raise
                failures.append(WriteFailure(Path(path_of(*args)), err))
                return None

        return guarded

    patched = [(engine.checkpoint_engine, "save", lambda state_dict, path, *rest: path),
               (engine, "_copy_recovery_script", lambda save_path: save_path)]
    patched = [(owner, name, path_of) for owner, name, path_of in patched if hasattr(owner, name)]
    for owner, name, path_of in patched:
        write = getattr(owner, name)
        if snapshot is not None and name == "_copy_recovery_script":
            write = snapshot.deferred(write)  # no script left beside a background save that failed
        setattr(owner, name, recording(write, path_of))
    try:
        yield
    finally:
        for owner, name, _ in patched:
            delattr(owner, name)  # the class's method again


def _write_full_module_file(engine, tag_dir: Path, failures: list[WriteFailure],
                            snapshot: SnapshotCheckpointEngine | None, frozen_weights: bool) -> None:
    dp_group = getattr(engine.optimizer, "dp_process_group", None)
    mp_rank = _model_parallel_rank(engine)
    writer = dist.get_rank(group=dp_group) == 0
    scratch = _Scratch(tag_dir / layout.gathered_module_scratch_name(mp_rank)) if writer and not failures else None
    path = tag_dir / layout.model_states_name(mp_rank)
    try:
        module = _gather_full_module(engine.module, scratch, frozen_weights)
        if module is not None:
            dp_rank0_file = tag_dir / layout.zero3_model_states_name(0, mp_rank)
            if snapshot is not None:  # the module's tensors are the scratch file's, no copy needed
                snapshot.add(path, {**snapshot.state_of(dp_rank0_file), "module": module})
            else:
                state = load_checkpoint_file(dp_rank0_file)
                state["module"] = module
                write_atomically(path, lambda tmp: torch.save(state, tmp))
    except Exception as err:
        if not is_write_error(err):
            raise
        failures.append(WriteFailure(path, err))
    finally:
        if scratch is not None:
            scratch.path.unlink(missing_ok=True)  # the mapping lives on until the tensors are gone
    barrier()


def _model_parallel_rank(engine) -> int:
    """The MP rank in the names of the files DeepSpeed wrote: ``engine.checkpoint_mp_rank`` where the
    engine has it (0.19), else what older releases compute inline when they name the files."""
    rank = getattr(engine, "checkpoint_mp_rank", None)
    if rank is not None:
        return rank
    return 0 if engine.mpu is None else engine.mpu.get_model_parallel_rank()


def _gather_full_module(module: torch.nn.Module, scratch: _Scratch | None,
                        frozen_weights: bool = True) -> dict[str, torch.Tensor] | None:
    """The module's state dict with whole ZeRO-3 parameters, gathered one at a time into ``scratch``
    (without ``frozen_weights``: less the parameters that do not train, as DeepSpeed's own module leaves them).

    Every rank of the parameters' partition group must call it; the rank with a ``scratch`` gets the
    state dict, its tensors mapped from the scratch file, so the whole module is never in its memory.
    """
    index: dict[int, int] = {}
    names = {}
    frozen = set() if frozen_weights else {name for name, param in module.named_parameters() if not param.requires_grad}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name in frozen:
            continue
        if id(tensor) not in index:
            value = _gather_param(tensor) if is_partitioned(tensor) else tensor.detach()
            index[id(tensor)] = scratch.add(value) if scratch is not None else -1
        names[name] = index[id(tensor)]
    if scratch is None:
        return None
    tensors = scratch.tensors()
    return {name: tensors[i] for name, i in names.items()}


class _Scratch:
    """Whole tensors parked in a file instead of in memory: their pages belong to the page cache, which
    the kernel writes back and drops as it needs, so gathering a model costs one tensor of memory."""

    _ALIGN = 64

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115 - closed in tensors()
        self._entries: list[tuple[int, torch.dtype, torch.Size]] = []

    def add(self, value: torch.Tensor) -> int:
        value = value.detach().cpu().contiguous()
        offset = self._file.tell()
        if offset % self._ALIGN:
            self._file.write(bytes(self._ALIGN - offset % self._ALIGN))
            offset = self._file.tell()
        self._file.write(value.reshape(-1).view(torch.uint8).numpy().data)
        self._entries.append((offset, value.dtype, value.shape))
        return len(self._entries) - 1

    def tensors(self) -> list[torch.Tensor]:
        self._file.close()
        if not any(shape.numel() for _, _, shape in self._entries):
            return [torch.empty(shape, dtype=dtype) for _, dtype, shape in self._entries]
        with open(self.path, "rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        return [torch.frombuffer(mapped, dtype=dtype, count=shape.numel(), offset=offset).view(shape)
                if shape.numel() else torch.empty(shape, dtype=dtype)
                for offset, dtype, shape in self._entries]


def _gather_param(param: torch.nn.Parameter) -> torch.Tensor:
    if getattr(param, "_z3_optimizer", None) is not None:
        master = safe_get_full_fp32_param(param)  # None for a parameter the optimizer does not hold
        if master is not None:
            return master
    with zero.GatheredParameters([param]):
        return param.data.detach().clone()

