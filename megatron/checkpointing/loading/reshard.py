"""A full resume at another shape: data-parallel size, tensor-parallel size, ZeRO stage or precision.

Built on DeepSpeed's own machinery, one job each:

* Reading: every rank reads the saved optimizer shards (ZeRO 1-3, and the bf16 optimizer's) in memory
  with DeepSpeed's own checkpoint readers and cuts each parameter's fp32 master, exp_avg and exp_avg_sq
  out of them as ds_to_universal's extraction does (``SavedOptimizerState``): no converted copy is
  written, so nothing is written at all, and the files read are the tag's own, checked against its
  manifest by the load and unpickled weights-only.
* Tensor parallelism: the saved tensor-parallel slices of each parameter, whole over data parallelism,
  go to ``megatron.model.partitioning``, which re-slices them to this run's size as it does for weights
  (fused QKV and gated MLP blocks, replicated key/value heads).
* Writing: the module and the fp32 master through ``module_load.load_module_only`` (the same path
  and verification as a module-only load), the moments through DeepSpeed's public
  ``safe_set_full_optimizer_state`` (ZeRO 1-3, the bf16 optimizer; DeepSpeed's optimizers without
  ZeRO offer no such state, so a run at stage 0 is refused), the step count into every state and
  group of the base optimizer.

A same-shape resume never comes here: it stays on DeepSpeed's ``engine.load_checkpoint``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk.inventory import TagInventory
from megatron.checkpointing.planning.shape import ShapeChange
from megatron.runtime.collective import first_report

MOMENTS = ("exp_avg", "exp_avg_sq")
_MASTER = "fp32"
_STEP = "step"


def resume_at_another_shape(engine, tag: TagInventory, change: ShapeChange, arch, module_weights: dict[str, torch.Tensor]):
    """Load `tag`'s full training state into `engine` (collective). `module_weights` is this rank's
    tensor-parallel part of the saved module (keys and buffers); returns the module-load report."""
    from megatron.checkpointing.loading.module_load import load_module_only

    problem = None
    try:
        saved = SavedOptimizerState(tag, change.saved.tensor_parallel, arch)
    except CheckpointError as err:
        problem = str(err)
    problem = first_report(problem)  # every rank stops when one could not read
    if problem:
        raise CheckpointError(problem)
    names = {param: name for name, param in engine.module.named_parameters()}
    masters = {name: saved.part(name, _MASTER) for name in names.values() if saved.holds(name)}
    report = load_module_only(engine, {**module_weights, **masters})
    step = saved.step()
    _set_moments(engine, names, saved)
    set_step(engine, step)
    engine.global_steps = int(tag.metadata.global_steps or step)
    engine.global_samples = engine.global_steps * engine.train_batch_size()
    return report


class SavedOptimizerState:
    """Each parameter's saved fp32 master, exp_avg and exp_avg_sq, read in memory from `tag`'s optimizer
    shards on this rank, as ds_to_universal's extraction and merge read them, without its files.

    DeepSpeed's own readers do the reading: ``DeepSpeedCheckpoint`` and its ZeRO reader (the shards of
    ZeRO 1-2 and of the bf16 optimizer, their paddings stripped, each parameter's fragment found through
    its ``param_slice_mappings``), and ds_to_universal's ZeRO-3 file grid with the partitioned sizes of
    each sub-group's parameters. Every torch.load is weights-only; the files were checked against the
    tag's manifest by the load (``files_read``).
    """

    def __init__(self, tag: TagInventory, saved_tensor_parallel: int, arch):
        from torch.utils.serialization import config as torch_load_config

        from megatron.checkpointing.ondisk.safe_unpickle import every_torch_load_weights_only

        self.saved, self.arch = saved_tensor_parallel, arch
        # name -> saved tensor-parallel rank -> state -> its fragments in data-parallel order, and the shapes
        self._fragments: dict[str, dict[int, dict[str, list[torch.Tensor]]]] = {}
        self._shapes: dict[str, dict[int, torch.Size]] = {}
        self._steps: set[int] = set()
        try:
            # mapped, not read: DeepSpeed's readers load whole model-states files for their shapes alone, and
            # only each parameter's fragments of a shard are copied out (privately mapped: nothing is written)
            with every_torch_load_weights_only(tag.path), torch_load_config.patch("load.mmap", True):
                if tag.metadata.zero_stage == 3:
                    self._read_zero3(tag)
                else:
                    self._read_zero12(tag.path)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"DeepSpeed's checkpoint readers could not read the optimizer shards of {tag.path} for a resume "
                f"at another shape: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Resume "
                "at the shape it was saved at, or set `no_load_optim: true` to keep its weights with a fresh "
                "optimizer."
            ) from None
        read = {len(slices) for slices in self._shapes.values()}
        if read != {self.saved}:
            raise CheckpointError(
                f"the optimizer shards of {tag.path} are of {sorted(read)} tensor-parallel rank(s), its model-states "
                f"files of {self.saved}; the optimizer state cannot be resharded from them. Set `no_load_optim: true` "
                "to keep the weights with a fresh optimizer."
            )

    def _add(self, name: str, tp: int, shape, states: dict[str, torch.Tensor], offset: int, numel: int) -> None:
        self._shapes.setdefault(name, {})[tp] = torch.Size(shape)
        fragments = self._fragments.setdefault(name, {}).setdefault(tp, {})
        for state, flat in states.items():
            fragments.setdefault(state, []).append(flat.narrow(0, offset, numel))

    def _read_zero12(self, tag_dir: Path) -> None:
        from deepspeed.checkpoint import DeepSpeedCheckpoint
        from deepspeed.checkpoint.constants import (
            BASE_OPTIMIZER_STATE,
            OPTIMIZER_STATE_DICT,
            PARAM_SHAPES,
            PARAM_SLICE_MAPPINGS,
            SINGLE_PARTITION_OF_FP32_GROUPS,
        )

        checkpoint = DeepSpeedCheckpoint(str(tag_dir))
        if checkpoint.pp_degree > 1:
            raise CheckpointError(f"{tag_dir} was saved with pipeline parallelism, whose optimizer state this "
                                  "resume cannot reshard. Resume at its shape, or set `no_load_optim: true`.")
        for tp in range(checkpoint.tp_degree):
            shapes = checkpoint.model_state_metadata[tp][1][PARAM_SHAPES]
            for dp in range(checkpoint.dp_degree):
                optim = checkpoint.get_zero_checkpoint_state(pp_index=0, tp_index=tp, dp_index=dp)[OPTIMIZER_STATE_DICT]
                groups = optim[BASE_OPTIMIZER_STATE]["state"]
                for group, mapping in enumerate(optim[PARAM_SLICE_MAPPINGS]):
                    flats = {_MASTER: optim[SINGLE_PARTITION_OF_FP32_GROUPS][group],
                             **{key: groups[group][key] for key in MOMENTS}}
                    if _STEP in groups[group]:
                        self._steps.add(int(groups[group][_STEP]))
                    for name, fragment in mapping.items():
                        self._add(name, tp, shapes[name], flats, fragment.start, fragment.numel)

    def _read_zero3(self, tag: TagInventory) -> None:
        from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, PARAM_SHAPES

        # the inventory has checked the (dp, mp) grid of files complete (preflight)
        tp_degree = 1 + max(mp for _, mp in tag.optimizer_files)
        dp_degree = 1 + max(dp for dp, _ in tag.optimizer_files)
        for tp in range(tp_degree):
            sub_groups = torch.load(tag.zero3_model_states_files[(0, tp)], map_location="cpu")[PARAM_SHAPES]
            for dp in range(dp_degree):
                optim = torch.load(tag.optimizer_files[(dp, tp)], map_location="cpu")[OPTIMIZER_STATE_DICT]
                partitions = optim.get("ds_zero_partition_groups") or []
                for index, shapes in enumerate(sub_groups):
                    inner = optim["optimizer_state_dict"]["state"][index]
                    if _STEP in inner:
                        self._steps.add(int(inner[_STEP]))
                    flats = {_MASTER: optim[FP32_FLAT_GROUPS][index], **{key: inner[key] for key in MOMENTS}}
                    partition = partitions[index] if index < len(partitions) else {}
                    count, rank = partition.get("partition_count", dp_degree), partition.get("partition_rank", dp)
                    offset = 0
                    for name, shape in shapes.items():
                        whole = torch.Size(shape).numel()
                        size = math.ceil(whole / count)  # each rank's part, the last one padded
                        self._add(name, tp, shape, flats, offset, max(0, min(size, whole - rank * size)))
                        offset += size

    def holds(self, name: str) -> bool:
        return name in self._fragments

    def whole_slices(self, name: str, state: str) -> list[torch.Tensor]:
        """`name`'s `state` on each saved tensor-parallel rank, whole over data parallelism."""
        return [torch.cat(self._fragments[name][tp][state]).view(self._shapes[name][tp])
                for tp in sorted(self._fragments[name])]

    def part(self, name: str, state: str) -> torch.Tensor:
        from megatron.core import parallel_state
        from megatron.model.partitioning import partitioning, repartition

        if parallel_state.model_parallel_is_initialized():
            rank = parallel_state.get_tensor_model_parallel_rank()
            size = parallel_state.get_tensor_model_parallel_world_size()
        else:
            rank, size = 0, 1
        return repartition(self.whole_slices(name, state), partitioning(name, self.arch), rank, size).contiguous()

    def step(self) -> int:
        if len(self._steps) != 1:
            raise CheckpointError(
                f"the optimizer shards record {'no' if not self._steps else 'several'} optimizer step "
                f"count(s) {sorted(self._steps)}; the optimizer state cannot be resumed from them. Set "
                "`no_load_optim: true` to keep the weights with a fresh optimizer."
            )
        return next(iter(self._steps))


def base_optimizer(engine) -> torch.optim.Optimizer | None:
    """The torch optimizer that holds the Adam state, inside DeepSpeed's wrappers."""
    optimizer = engine.optimizer
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _set_moments(engine, names: dict, reader: SavedOptimizerState) -> None:
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
    from megatron.optim.optimizers import replay_cpu_adam_step_count

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
