"""Read the module weights of exactly one checkpoint tag directory.

Sources, the first one present wins:

1. ``mp_rank_<MP>_model_states.pt`` whose ``module`` entry holds the weights (DeepSpeed ZeRO 0-2
   writes it; under ZeRO-3 ``save_engine_checkpoint`` adds it with the full fp32 values).
2. GPT-NeoX pipeline layer files ``layer_<II>-model_<MP>-model_states.pt``: each holds one layer's
   state dict; its keys become ``sequential.<int(II)>.<name>`` (``nn.Sequential`` naming).
3. The ZeRO-3 shards of the tag: fp32 flat partitions from ``*zero_pp_rank_<DP>_mp_rank_<MP>_optim_states.pt``
   plus names and shapes from ``zero_pp_rank_<DP>_mp_rank_<MP>_model_states.pt``.

Whatever the source, the names come back as this model's: GPT-NeoX's older MLP names
(``mlp.dense_h_to_4h`` / ``mlp.dense_4h_to_h``; the Llama MLP's ``mlp.w1`` / ``w3`` / ``w2``) as
``mlp.linear1`` / ``mlp.linear2``, and the rotary frequencies GPT-NeoX stored as a buffer dropped
(computed from the settings here); see legacy_names.py.

The ``latest`` file is never read, and no optimizer file is opened while a module source exists.
Every file is read by load_checkpoint_file: checked against the tag's manifest, where the tag has one,
before it is unpickled (once per node), and unpickled weights-only from the file that was checked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.legacy_names import is_legacy_key, translate_legacy_module
from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.ondisk.safe_unpickle import load_weights_only
from megatron.checkpointing.ondisk.verified_files import check_open_checkpoint_file
from megatron.ranks import tensor_parallel_rank, tensor_parallel_size


def load_checkpoint_file(path: Path) -> Any:
    """One checkpoint file on CPU, memory-mapped: checked against its tag's manifest (where the tag has one;
    once per node, verified_files), then unpickled weights-only (safe_unpickle), so reading it runs no code
    from it. The file is opened once: what is unpickled is the open file that was checked, even if the
    path is replaced meanwhile."""
    path = Path(path)
    with open(path, "rb", buffering=0) as handle:
        check_open_checkpoint_file(handle, path)
        return load_weights_only(_open_file_path(handle, path), shown_as=path)


def _open_file_path(handle, path: Path) -> Path:
    """A path that opens the very file `handle` has open (Linux's /proc/self/fd), for torch.load's mmap,
    which takes only paths; `path` itself where there is no /proc."""
    link = Path(f"/proc/self/fd/{handle.fileno()}")
    return link if link.exists() else path


def read_module_weights(tag_dir: str | Path, mp_rank: int = 0) -> dict[str, torch.Tensor]:
    """The module state dict stored in ``tag_dir`` (exactly that directory), keys as in this model's
    ``state_dict()`` (GPT-NeoX's older names translated)."""
    return translate_legacy_module(_stored_module_weights(tag_dir, mp_rank))


def legacy_names_in_model_states_file(tag_dir: str | Path, mp_rank: int = 0) -> list[str]:
    """The keys of the tag's model-states file that read_module_weights renames or drops (GPT-NeoX's older
    names); DeepSpeed's own load, which a full resume uses, would look for them under those names."""
    module = _module_from_model_states_file(Path(tag_dir) / layout.model_states_name(mp_rank)) or {}
    return [name for name in module if is_legacy_key(name)]


def _stored_module_weights(tag_dir: str | Path, mp_rank: int) -> dict[str, torch.Tensor]:
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        raise CheckpointError(f"checkpoint tag directory {tag_dir} does not exist")

    module = _module_from_model_states_file(tag_dir / layout.model_states_name(mp_rank))
    if module is not None:
        return module
    layer_files = _layer_files(tag_dir, mp_rank)
    if layer_files:
        return _module_from_layer_files(layer_files)
    model_files, optim_files = _zero_shard_files(tag_dir, mp_rank)
    if model_files and optim_files:
        return _module_from_zero3_shards(tag_dir, model_files, optim_files)

    contents = sorted(p.name for p in tag_dir.iterdir())
    raise CheckpointError(
        f"no module weights in {tag_dir}: expected {layout.model_states_name(mp_rank)} with a 'module' entry, "
        f"GPT-NeoX layer files layer_<II>-model_{mp_rank:02d}-model_states.pt, or ZeRO-3 shards "
        f"(zero_pp_rank_<DP>_mp_rank_{mp_rank:02d}_model_states.pt together with "
        f"*zero_pp_rank_<DP>_mp_rank_{mp_rank:02d}_optim_states.pt); the directory holds {contents or 'nothing'}"
    )


def read_full_module_weights(tag_dir: str | Path, tensor_parallel_size: int, arch) -> dict[str, torch.Tensor]:
    """The module of ``tag_dir`` as whole tensors: the ``tensor_parallel_size`` ranks' parts joined
    along their split dimensions (``arch``, a megatron.model Architecture, says which)."""
    from megatron.model.partitioning import repartition_state_dict

    parts = [_rank_part(tag_dir, mp, tensor_parallel_size, arch) for mp in range(tensor_parallel_size)]
    return parts[0] if tensor_parallel_size == 1 else repartition_state_dict(parts, arch, 0, 1)


def this_ranks_part(parts: list[dict[str, torch.Tensor]], arch) -> dict[str, torch.Tensor]:
    """This tensor-parallel rank's slices of weights saved by ``len(parts)`` ranks (memory-mapped parts are
    read only where the slices lie); ``arch``, the run's Architecture, says how each tensor is split."""
    from megatron.model.partitioning import repartition_state_dict

    rank, size = tensor_parallel_rank(), tensor_parallel_size()
    if len(parts) == size:
        return parts[rank]
    return repartition_state_dict(parts, arch, rank, size)


def read_this_ranks_module_weights(tag_dir: str | Path, saved_tensor_parallel_size: int,
                                   arch) -> dict[str, torch.Tensor]:
    """This tensor-parallel rank's module weights from a tag saved by ``saved_tensor_parallel_size`` ranks:
    its own rank file at the same size, re-split from every rank file at another."""
    if saved_tensor_parallel_size == tensor_parallel_size():
        return _rank_part(tag_dir, tensor_parallel_rank(), saved_tensor_parallel_size, arch)
    return this_ranks_part([_rank_part(tag_dir, mp, saved_tensor_parallel_size, arch)
                            for mp in range(saved_tensor_parallel_size)], arch)


def _rank_part(tag_dir: str | Path, mp_rank: int, saved_tensor_parallel_size: int, arch) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``mp_rank``'s module weights of a tag saved by ``saved_tensor_parallel_size`` ranks,
    refused in one line where they lack experts that rank held (a lost rank file, a cut expert weight)."""
    from megatron.model.partitioning import experts_named, local_experts, missing_experts

    try:
        weights = read_module_weights(tag_dir, mp_rank)
    except CheckpointError as err:
        if not arch.moe:
            raise
        held = experts_named(local_experts(arch, mp_rank, saved_tensor_parallel_size))
        raise CheckpointError(f"{held} of every expert layer missing (tensor-parallel rank {mp_rank} of "
                              f"{saved_tensor_parallel_size} held them): {err}") from None
    for name, value in weights.items():
        problem = missing_experts(name, value, arch, mp_rank, saved_tensor_parallel_size)
        if problem:
            model_states = Path(tag_dir) / layout.model_states_name(mp_rank)
            source = model_states if model_states.is_file() else f"{tag_dir} (tensor-parallel rank {mp_rank})"
            raise CheckpointError(f"{source}: {problem}. The checkpoint lost experts (or was saved at another "
                                  "tensor-parallel size than it records); restore its files or load another tag.")
    return weights


def _module_from_model_states_file(path: Path) -> dict[str, torch.Tensor] | None:
    if not path.is_file():
        return None
    module = load_checkpoint_file(path).get("module")
    # GPT-NeoX pipeline checkpoints keep this file for client state only (module is None); ZeRO-3
    # model-states files hold empty placeholders. Neither carries weights.
    if not module or not any(tensor.numel() > 0 for tensor in module.values()):
        return None
    return dict(module)


def _layer_files(tag_dir: Path, mp_rank: int) -> dict[int, Path]:
    layers = {}
    for path in tag_dir.iterdir():
        match = layout.LAYER_FILE_RE.match(path.name)
        if match and int(match["mp"]) == mp_rank:
            layers[int(match["layer"])] = path
    return dict(sorted(layers.items()))


def _module_from_layer_files(layer_files: dict[int, Path]) -> dict[str, torch.Tensor]:
    module = {}
    for index, path in layer_files.items():
        layer_state = load_checkpoint_file(path)
        if not isinstance(layer_state, dict):
            raise CheckpointError(f"{path} holds a {type(layer_state).__name__}, expected a layer state dict")
        for name, tensor in layer_state.items():
            module[f"sequential.{index}.{name}"] = tensor
    return module


def layer_states(module: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """``module`` (``sequential.<II>.<name>``) split as GPT-NeoX's layer files hold it: II -> {name: tensor}."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for full_name, tensor in module.items():
        position, name = full_name.removeprefix("sequential.").split(".", 1)
        layers.setdefault(int(position), {})[name] = tensor
    return dict(sorted(layers.items()))


def _zero_shard_files(tag_dir: Path, mp_rank: int) -> tuple[dict[int, Path], dict[int, Path]]:
    model_files, optim_files = {}, {}
    for path in tag_dir.iterdir():
        for pattern, found in ((layout.ZERO3_MODEL_STATES_RE, model_files), (layout.OPTIM_STATES_RE, optim_files)):
            match = pattern.match(path.name)
            if match and int(match["mp"]) == mp_rank:
                found[int(match["dp"])] = path
    return dict(sorted(model_files.items())), dict(sorted(optim_files.items()))


def _module_from_zero3_shards(
    tag_dir: Path, model_files: dict[int, Path], optim_files: dict[int, Path]
) -> dict[str, torch.Tensor]:
    """Reassemble full fp32 tensors from the per-rank ZeRO-3 flat partitions.

    Layout (DeepSpeed ZeRO-3): every rank's fp32 sub-groups, laid end to end, hold one partition of
    each trainable parameter in ``param_shapes`` order; a parameter of n elements takes ceil(n / DP)
    elements on every rank, and its full value is the ranks' partitions concatenated, cut to n.
    Frozen parameters are stored the same way, one fragment per rank in the model-states files.
    """
    from megatron.model.zero3_partition import (
        partition_numel,  # imports DeepSpeed: only when ZeRO-3 shards are read
    )

    first_optim = load_checkpoint_file(optim_files[min(optim_files)])["optimizer_state_dict"]
    stage = first_optim.get("zero_stage")
    if int(stage) != 3:
        raise CheckpointError(
            f"{tag_dir} has ZeRO stage {stage} optimizer shards but no {layout.model_states_name(0)} with the "
            "module weights; only ZeRO-3 shards can stand in for a missing module file"
        )
    dp_size = int(first_optim["partition_count"])
    expected = set(range(dp_size))
    for kind, files in (("model-states", model_files), ("optimizer", optim_files)):
        if set(files) != expected:
            raise CheckpointError(
                f"{tag_dir}: the ZeRO-3 checkpoint was saved by {dp_size} data-parallel ranks but the "
                f"{kind} files present are for ranks {sorted(files)}; the checkpoint is incomplete"
            )

    rank_streams = []
    for rank in range(dp_size):
        state = (
            first_optim
            if rank == min(optim_files)
            else load_checkpoint_file(optim_files[rank])["optimizer_state_dict"]
        )
        rank_streams.append(torch.cat([group.reshape(-1) for group in state["fp32_flat_groups"]]))
    model_states = [load_checkpoint_file(model_files[rank]) for rank in range(dp_size)]
    first_model = model_states[0]

    module: dict[str, torch.Tensor] = {}
    buffer_names = set(first_model.get("buffer_names") or [])
    module.update({name: t for name, t in (first_model.get("module") or {}).items() if name in buffer_names})

    offset = 0
    for group_shapes in first_model["param_shapes"]:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            partition = partition_numel(numel, dp_size)
            pieces = [stream.narrow(0, offset, partition) for stream in rank_streams]
            module[name] = torch.cat(pieces)[:numel].view(tuple(shape)).clone()
            offset += partition
    for rank, stream in enumerate(rank_streams):
        if stream.numel() != offset:
            raise CheckpointError(
                f"{optim_files[rank]}: holds {stream.numel()} fp32 elements but the parameter shapes in "
                f"{model_files[0].name} account for {offset}; the shards do not belong together"
            )

    for name, shape in (first_model.get("frozen_param_shapes") or {}).items():
        fragments = [state["frozen_param_fragments"][name].reshape(-1) for state in model_states]
        module[name] = torch.cat(fragments)[: math.prod(shape)].view(tuple(shape)).clone()

    for alias, owner in (first_model.get("shared_params") or {}).items():
        if owner in module:
            module[alias] = module[owner]
    return module
