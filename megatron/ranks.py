"""Which rank this process is: in the job, in its data-parallel, tensor-parallel and context-parallel groups.

A leaf: every layer asks here, also before torch.distributed or megatron-core's groups exist (then
the launcher's RANK, or the answer of a process that is alone).
"""

from __future__ import annotations

import os
import sys


def _process_group_exists() -> bool:
    # Not imported yet, or still being imported by another thread: no group exists, and asking must not import
    # torch (a rank's start-up announces itself while it imports torch: megatron.logging.slow_stage).
    dist = sys.modules.get("torch.distributed")
    return hasattr(dist, "is_initialized") and dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    """This process's rank in the job; before the process group exists, the launcher's RANK (0 when started alone)."""
    if _process_group_exists():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def rank_and_world() -> tuple[int, int]:
    """(rank, number of ranks) of the process group collectives run over; (0, 1) without one."""
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if _process_group_exists() else (0, 1)


def _model_parallel_groups_exist() -> bool:
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def data_parallel_rank_and_size() -> tuple[int, int]:
    """(rank, size) in the data-parallel group; (0, 1) before megatron-core's groups exist."""
    from megatron.core import parallel_state

    if not _model_parallel_groups_exist():
        return 0, 1
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def replicas_and_context_parallel_size() -> int:
    """Ranks holding the same weights: data-parallel x context-parallel, the group ZeRO partitions over and the
    gradients are reduced over; 1 before megatron-core's groups exist."""
    from megatron.core import parallel_state

    if not _model_parallel_groups_exist():
        return 1
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def context_parallel_rank_and_size() -> tuple[int, int]:
    """(rank, size) in the context-parallel group (the ranks splitting each sequence); (0, 1) before megatron-core's
    groups exist."""
    from megatron.core import parallel_state

    if not _model_parallel_groups_exist():
        return 0, 1
    return parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()


def tensor_parallel_rank() -> int:
    """Rank in the tensor-parallel group; 0 before megatron-core's groups exist."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() if _model_parallel_groups_exist() else 0


def tensor_parallel_size() -> int:
    """Size of the tensor-parallel group; 1 before megatron-core's groups exist."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size() if _model_parallel_groups_exist() else 1
