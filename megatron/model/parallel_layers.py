"""megatron-core's tensor-parallel layers, configured once for this model.

The subclasses leave megatron-core's always-empty ``_extra_state`` entries out of the state dicts
they save, so a state dict holds exactly GPT-NeoX's parameter names; loading still accepts a state
dict with or without them (megatron-core fills in and ignores the entry).
"""

from __future__ import annotations

import torch
import torch.distributed.nn.functional

from megatron.contract.architecture import ModelConfigError
from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.ranks import tensor_parallel_rank, tensor_parallel_size


def model_parallel_config() -> ModelParallelConfig:
    if not parallel_state.model_parallel_is_initialized():
        raise ModelConfigError(
            "megatron-core's process groups are not initialised; call "
            "megatron.core.parallel_state.initialize_model_parallel after torch.distributed before building the model"
        )
    # The weights are drawn afterwards, whole and then split (init_methods.initialise_parameters).
    return ModelParallelConfig(
        tensor_model_parallel_size=tensor_parallel_size(),
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=torch.float32,
    )


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension over the tensor-parallel group; the gradient of the result
    (the same on every rank of the group) passes back to each rank's own slice."""

    @staticmethod
    def forward(ctx, part: torch.Tensor) -> torch.Tensor:
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(part) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.chunk(tensor_parallel_size(), dim=-1)[tensor_parallel_rank()].contiguous()


def gather_last_dim(part: torch.Tensor) -> torch.Tensor:
    """The tensor-parallel ranks' parts of the last dimension, joined (megatron-core's own gather needs CUDA)."""
    return part if tensor_parallel_size() == 1 else _GatherLastDim.apply(part)


class _SplitLastDim(torch.autograd.Function):
    """This rank's slice of the last dimension of a tensor every tensor-parallel rank holds whole; the gradient
    is the ranks' slices gathered (megatron-core's scatter gathers its gradient on CUDA only)."""

    @staticmethod
    def forward(ctx, whole: torch.Tensor) -> torch.Tensor:
        return whole.chunk(tensor_parallel_size(), dim=-1)[tensor_parallel_rank()].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _GatherLastDim.forward(ctx, grad)


def split_last_dim(whole: torch.Tensor) -> torch.Tensor:
    return whole if tensor_parallel_size() == 1 else _SplitLastDim.apply(whole)


def sum_over_ranks_sharing_a_slot(part: torch.Tensor, slot: int, slots: int) -> torch.Tensor:
    """The sum of ``part`` over the tensor-parallel ranks that hold the same ``slot`` of ``slots``.

    One all-reduce over the tensor-parallel group of a buffer with a place for every slot, each rank
    writing into its own: adding the other slots' zeros is exact, and no sub-groups are needed.
    """
    buffer = part.new_zeros((slots, *part.shape))
    buffer[slot] = part
    torch.distributed.all_reduce(buffer, group=parallel_state.get_tensor_model_parallel_group())
    return buffer[slot]


def sum_over_tensor_parallel_ranks(part: torch.Tensor) -> torch.Tensor:
    """The sum of ``part`` over the tensor-parallel group (a gradient hook's new gradient)."""
    total = part.clone()
    torch.distributed.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    return total


def sum_over_tensor_parallel_ranks_and_back(part: torch.Tensor) -> torch.Tensor:
    """The sum of ``part`` over the tensor-parallel group, its gradient summed over the group as well: every rank
    goes on with the sum, so the gradient of each rank's part is every rank's gradient of the sum."""
    return torch.distributed.nn.functional.all_reduce(part, group=parallel_state.get_tensor_model_parallel_group())


def copy_to_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; the gradient is summed over the tensor-parallel group."""
    return x if tensor_parallel_size() == 1 else tensor_parallel.copy_to_tensor_model_parallel_region(x)


def reduce_from_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel group; the gradient passes to each rank as it is."""
    return x if tensor_parallel_size() == 1 else tensor_parallel.reduce_from_tensor_model_parallel_region(x)


class _WithoutExtraState:
    get_extra_state = torch.nn.Module.get_extra_state


class ColumnParallelLinear(_WithoutExtraState, tensor_parallel.ColumnParallelLinear):
    pass


class RowParallelLinear(_WithoutExtraState, tensor_parallel.RowParallelLinear):
    pass


class VocabParallelEmbedding(_WithoutExtraState, tensor_parallel.VocabParallelEmbedding):
    pass
