"""A full resume at another shape: data-parallel size, tensor-parallel size, ZeRO stage or precision.

Built on DeepSpeed's own machinery, one job each:

* Reading: ``deepspeed.checkpoint.ds_to_universal`` turns the saved optimizer shards (ZeRO 1-3, and
  the bf16 optimizer's where it writes them) into one whole fp32 master, exp_avg, exp_avg_sq and step
  per parameter. Global rank 0 converts into a folder of this run's (``<save>/<tag>.reshard``,
  never the loaded tag, which may be shared and read-only), records a manifest over it, and every
  rank reads it back checked against that manifest and weights-only.
* Tensor parallelism: with no slicing patterns declared, ds_to_universal concatenates the saved
  tensor-parallel slices along dim 0, so cutting the whole tensor back into ``saved`` equal parts gives
  each saved rank's slice exactly; ``megatron.model.partitioning`` then re-slices them to this run's size
  as it does for weights (fused QKV and gated MLP blocks, replicated key/value heads).
* Writing: the module and the fp32 master through ``module_load.load_module_only`` (the same path
  and verification as a module-only load), the moments through DeepSpeed's public
  ``safe_set_full_optimizer_state`` (ZeRO 1-3, the bf16 optimizer; DeepSpeed's optimizers without
  ZeRO offer no such state, so a run at stage 0 is refused), the step count into every state and
  group of the base optimizer.

A same-shape resume never comes here: it stays on DeepSpeed's ``engine.load_checkpoint``.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.checkpointing import layout, manifest
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.inventory import TagInventory
from megatron.collective import all_gather, barrier
from megatron.optimizer_layout import precision_of, zero_stage_of
from megatron.ranks import rank_and_world

MOMENTS = ("exp_avg", "exp_avg_sq")
_MASTER = "fp32"
_STEP = "step"


@dataclass(frozen=True)
class Shape:
    data_parallel: int
    tensor_parallel: int
    zero_stage: int
    precision: str

    def describe(self) -> str:
        return f"DP {self.data_parallel} x TP {self.tensor_parallel}, ZeRO-{self.zero_stage}"


@dataclass(frozen=True)
class ShapeChange:
    saved: Shape
    run: Shape
    work_dir: Path | None = None  # where the resharded copy goes: under `save`, never into the loaded tag

    def describe(self) -> str:
        line = f"full resume at another shape: optimizer state resharded from {self.saved.describe()} to {self.run.describe()}"
        if self.saved.precision != self.run.precision:
            line += (f", {self.saved.precision} to {self.run.precision} (the fp32 master and Adam moments carry "
                     "over as saved)")
        return line

    def notes(self) -> list[str]:
        notes = [self.describe()]
        if self.saved.precision == "fp16" and self.run.precision != "fp16":
            notes.append(f"fp16 loss scaler not carried over: {self.run.precision} trains without one")
        elif self.run.precision == "fp16" and self.saved.precision != "fp16":
            notes.append(f"fp16 loss scaler starts at its initial scale: the {self.saved.precision} checkpoint has none")
        return notes


def saved_shape(tag: TagInventory, saved_tensor_parallel: int) -> Shape:
    meta = tag.metadata
    data_parallel = meta.dp_world_size or (max(tag.optimizer_dp_ranks) + 1 if tag.optimizer_files else 1)
    return Shape(int(data_parallel), saved_tensor_parallel, meta.zero_stage, meta.precision)


def run_shape(args, data_parallel_size: int) -> Shape:
    return Shape(data_parallel_size, args.model_parallel_size or 1, zero_stage_of(args.zero_optimization, args.zero_stage),
                 precision_of(args.precision, args.fp16, args.bf16))


def shape_change(tag: TagInventory, args, data_parallel_size: int, saved_tensor_parallel: int) -> ShapeChange | None:
    """The change between the shape `tag` was saved at and this run's; None when a same-shape resume does.

    Without ZeRO the whole optimizer state sits in the model-states file, which DeepSpeed loads at
    any data-parallel size: a data-parallel change alone is no change there.
    """
    saved, run = saved_shape(tag, saved_tensor_parallel), run_shape(args, data_parallel_size)
    if saved.zero_stage == run.zero_stage == 0:
        saved = Shape(run.data_parallel, saved.tensor_parallel, saved.zero_stage, saved.precision)
    if saved == run:
        return None
    return ShapeChange(saved, run, Path(args.save).expanduser() / layout.reshard_dir_name(tag.tag) if args.save else None)


def refusal(tag: TagInventory, args, way_out: str) -> str | None:
    """Why `tag`'s optimizer state cannot be resharded into this run (one line), or None."""
    if not tag.optimizer_files:
        return (f"{tag.path} keeps its optimizer state inside {layout.model_states_name(0)} (ZeRO stage 0 in "
                f"{tag.metadata.precision}), which DeepSpeed's universal checkpoint cannot read, so it resumes "
                f"only at its own shape (ZeRO stage 0, {tag.metadata.precision}, the same tensor-parallel size). "
                f"Resume there, or {way_out}.")
    if run_shape(args, 1).zero_stage == 0:
        return (f"a full resume of {tag.path} at another shape writes the Adam moments through DeepSpeed's "
                "per-parameter optimizer-state API, which its optimizers without ZeRO do not offer. Set "
                f"zero_optimization.stage to 1, 2 or 3 (or to {tag.metadata.zero_stage} at the saved shape), or {way_out}.")
    if not args.save:
        return (f"a full resume at another shape writes a resharded copy of {tag.path} into the save directory, and "
                f"`save` is not set. Set `save: <directory>`, or {way_out}.")
    return None


def files_read(tag: TagInventory) -> tuple[Path, ...]:
    """Every file the conversion reads: all model-states files and every optimizer shard."""
    return tuple(sorted({*tag.model_states_files.values(), *tag.zero3_model_states_files.values(),
                         *tag.optimizer_files.values()}))


def resume_at_another_shape(engine, tag: TagInventory, change: ShapeChange, arch, module_weights: dict[str, torch.Tensor]):
    """Load `tag`'s full training state into `engine` (collective). `module_weights` is this rank's
    tensor-parallel part of the saved module (keys and buffers); returns the module-load report."""
    from megatron.checkpointing.module_load import load_module_only

    work = change.work_dir
    _convert_on_one_rank(tag, work)
    try:
        universal = work / layout.RESHARD_UNIVERSAL_DIR
        reader = _UniversalReader(universal, change.saved.tensor_parallel, arch)
        names = {param: name for name, param in engine.module.named_parameters()}
        masters = {name: reader.part(name, _MASTER) for name in names.values() if reader.holds(name)}
        report = load_module_only(engine, {**module_weights, **masters})
        step = reader.step()
        _set_moments(engine, names, reader)
        set_step(engine, step)
        engine.global_steps = int(tag.metadata.global_steps or step)
        engine.global_samples = engine.global_steps * engine.train_batch_size()
    finally:
        barrier()  # every rank has read the copy
        if rank_and_world()[0] == 0:
            shutil.rmtree(work, ignore_errors=True)
    return report


def _convert_on_one_rank(tag: TagInventory, work: Path) -> None:
    """Global rank 0 converts `tag` into `work`; every rank raises rank 0's error when it failed."""
    problem = None
    if rank_and_world()[0] == 0:
        try:
            convert_to_universal(tag, work)
        except CheckpointError as err:
            problem = str(err)
    problem = all_gather(problem)[0]
    if problem:
        raise CheckpointError(problem)


def convert_to_universal(tag: TagInventory, work: Path) -> Path:
    """Run DeepSpeed's ds_to_universal on `tag` into ``work/<RESHARD_UNIVERSAL_DIR>``, record its manifest.

    It reads a folder of links to exactly the files it understands (our ZeRO-3 tags also hold a full
    module file it would take for a shard), every torch.load weights-only.
    """
    from deepspeed.checkpoint import ds_to_universal

    from megatron.checkpointing.safe_unpickle import every_torch_load_weights_only

    shutil.rmtree(work, ignore_errors=True)  # left by a run killed while it loaded
    sources = work / "input"
    sources.mkdir(parents=True)
    stage3 = tag.metadata.zero_stage == 3
    for path in files_read(tag):
        if not (stage3 and layout.MODEL_STATES_RE.match(path.name)):
            (sources / path.name).symlink_to(path.resolve())
    output = work / layout.RESHARD_UNIVERSAL_DIR
    options = Namespace(input_folder=str(sources), output_folder=str(output), num_extract_workers=1,
                        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    chatter = io.StringIO()
    try:
        with every_torch_load_weights_only(tag.path), contextlib.redirect_stdout(chatter), \
                contextlib.redirect_stderr(chatter):
            ds_to_universal.main(options)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"DeepSpeed's ds_to_universal could not convert {tag.path} for a resume at another shape: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Resume at the shape it was saved "
            "at, or set `no_load_optim: true` to keep its weights with a fresh optimizer."
        ) from None
    records = {name: manifest.FileRecord(size=(output / name).stat().st_size, checksum=manifest.CHECKSUM,
                                         digest=manifest.file_checksum(output / name))
               for name in manifest.tag_file_names(output)}
    manifest.write_manifest(output, records)
    return output


class _UniversalReader:
    """This rank's tensor-parallel part of each parameter's state in a ds_to_universal folder."""

    def __init__(self, root: Path, saved_tensor_parallel: int, arch):
        self.root, self.saved, self.arch = root, saved_tensor_parallel, arch
        self.records = manifest.read_manifest(root)

    def holds(self, name: str) -> bool:
        return (self._path(name, _MASTER)).is_file()

    def _path(self, name: str, state: str) -> Path:
        return self.root / layout.UNIVERSAL_DIR / name / f"{state}.pt"

    def _read(self, path: Path):
        from megatron.checkpointing.safe_unpickle import load_weights_only

        problem = manifest.check_file(path, self.records, self.root)
        if problem:
            raise CheckpointError(problem)
        return load_weights_only(path)

    def whole(self, name: str, state: str) -> torch.Tensor:
        from deepspeed.checkpoint.constants import PARAM

        return self._read(self._path(name, state))[PARAM]

    def part(self, name: str, state: str) -> torch.Tensor:
        from megatron.core import parallel_state
        from megatron.model.partitioning import partitioning, repartition

        value = self.whole(name, state)
        saved_parts = list(value.chunk(self.saved, dim=0)) if self.saved > 1 else [value]
        if parallel_state.model_parallel_is_initialized():
            rank = parallel_state.get_tensor_model_parallel_rank()
            size = parallel_state.get_tensor_model_parallel_world_size()
        else:
            rank, size = 0, 1
        return repartition(saved_parts, partitioning(name, self.arch), rank, size).contiguous()

    def step(self) -> int:
        steps = {int(self._read(path)) for path in (self.root / layout.UNIVERSAL_DIR).glob(f"*/{_STEP}.pt")}
        if not steps:  # ZeRO-3 shards keep it only in the optimizer state ds_to_universal copies whole
            saved = self._read(self.root / layout.UNIVERSAL_DIR / "optimizer_state.pt")
            inner = saved.get("optimizer_state_dict") or saved.get("base_optimizer_state") or {}
            steps = {int(state["step"]) for state in inner.get("state", {}).values() if "step" in state}
        if len(steps) != 1:
            raise CheckpointError(
                f"the universal copy in {self.root} records {'no' if not steps else 'several'} optimizer step "
                f"count(s) {sorted(steps)}; the optimizer state cannot be resumed from it. Set `no_load_optim: true` "
                "to keep the weights with a fresh optimizer."
            )
        return steps.pop()


def base_optimizer(engine) -> torch.optim.Optimizer | None:
    """The torch optimizer that holds the Adam state, inside DeepSpeed's wrappers."""
    optimizer = engine.optimizer
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _set_moments(engine, names: dict, reader: _UniversalReader) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    _link_moment_fragments(engine.optimizer, base_optimizer(engine))
    for param, name in names.items():
        if not param.requires_grad or not reader.holds(name):
            continue
        if not (hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")):  # the API would skip it silently
            raise CheckpointError(
                f"the optimizer {type(engine.optimizer).__name__} keeps no per-parameter state DeepSpeed's "
                f"safe_set_full_optimizer_state reaches ({name}), so the Adam moments cannot be restored at this "
                "shape. Use ZeRO stage 1, 2 or 3, or set `no_load_optim: true` for a fresh optimizer."
            )
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, reader.part(name, key).to(torch.float32), key)


def _link_moment_fragments(wrapper, optimizer: torch.optim.Optimizer) -> None:
    """Create the Adam moments of every flat fp32 partition and link each parameter's fragments to them,
    so safe_set_full_optimizer_state reaches them.

    DeepSpeed's ZeRO 1-3 and bf16 optimizers create the moments at the first step (zeros of each flat
    partition's shape, as created here); ZeRO 1-2 and the bf16 optimizer then link the fragments, but
    after stepping only the first parameter group (DeepSpeed 0.19.8), so the others' stay unlinked:
    they are linked again here by DeepSpeed's own method.
    """
    # ZeRO-3 hands its base optimizer one sub-group's partition at a time, so its groups do not list them all
    flats = getattr(wrapper, "fp32_partitioned_groups_flat", None) or [
        flat for group in optimizer.param_groups for flat in group["params"]]
    for flat in flats:
        state = optimizer.state[flat]
        for key in MOMENTS:
            state.setdefault(key, torch.zeros_like(flat))
    relink = getattr(wrapper, "_lazy_init_hp_params_optimizer_state", None)
    if relink is not None:  # ZeRO-3 reads the moments from the optimizer's state when asked
        wrapper._hp_optimizer_states_linked = False
        relink()


def set_step(engine, step: int) -> None:
    """The optimizer step count `step` in every state and parameter group of the base optimizer (FusedAdam
    steps with the count in each state and starts a new state from its group's; torch's Adam keeps a tensor)."""
    from megatron.optimizers import replay_cpu_adam_step_count

    optimizer = base_optimizer(engine)
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = step
    for state in optimizer.state.values():
        if state:
            if torch.is_tensor(state.get("step")):
                state["step"].fill_(step)
            else:  # also the states _link_moment_fragments created, which have none yet
                state["step"] = step
    replay_cpu_adam_step_count(engine)
