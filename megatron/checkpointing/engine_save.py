"""Save a checkpoint tag through the DeepSpeed engine, with a full module file under every ZeRO stage."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed import zero
from deepspeed.utils import safe_get_full_fp32_param

from megatron.checkpointing import layout
from megatron.checkpointing.module_weights import load_checkpoint_file
from megatron.fsio import write_atomically
from megatron.zero3_partition import is_partitioned


def save_engine_checkpoint(engine, save_dir: str | Path, tag: str, client_state: dict) -> Path:
    """Save tag ``tag`` under ``save_dir`` on every rank (collective); return the tag directory.

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

    Neither ``latest`` nor a manifest is written here (megatron.checkpointing.commit does that).
    """
    save_dir = Path(save_dir)
    tag_dir = save_dir / tag
    engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state, save_latest=False)
    if engine.zero_optimization_partition_weights():
        _write_full_module_file(engine, tag_dir)
    return tag_dir


def _write_full_module_file(engine, tag_dir: Path) -> None:
    dp_group = getattr(engine.optimizer, "dp_process_group", None)
    module = _gather_full_module(engine.module, keep=dist.get_rank(group=dp_group) == 0)
    if module is not None:
        mp_rank = _model_parallel_rank(engine)
        state = load_checkpoint_file(tag_dir / layout.zero3_model_states_name(0, mp_rank))
        state["module"] = module
        write_atomically(tag_dir / layout.model_states_name(mp_rank), lambda path: torch.save(state, path))
    dist.barrier()


def _model_parallel_rank(engine) -> int:
    """The MP rank in the names of the files DeepSpeed wrote: ``engine.checkpoint_mp_rank`` where the
    engine has it (0.19), else what older releases compute inline when they name the files."""
    rank = getattr(engine, "checkpoint_mp_rank", None)
    if rank is not None:
        return rank
    return 0 if engine.mpu is None else engine.mpu.get_model_parallel_rank()


def _gather_full_module(module: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor] | None:
    """The module's state dict with whole ZeRO-3 parameters, one parameter gathered at a time.

    Every rank of the parameters' partition group must call it; only where ``keep`` is the result kept.
    """
    gathered: dict[int, torch.Tensor] = {}
    full = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in gathered:
            value = _gather_param(tensor) if is_partitioned(tensor) else tensor.detach()
            gathered[id(tensor)] = value.cpu().clone() if keep else value
        full[name] = gathered[id(tensor)]
    return full if keep else None


def _gather_param(param: torch.nn.Parameter) -> torch.Tensor:
    if getattr(param, "_z3_optimizer", None) is not None:
        master = safe_get_full_fp32_param(param)  # None for a parameter the optimizer does not hold
        if master is not None:
            return master
    with zero.GatheredParameters([param]):
        return param.data.detach().clone()

