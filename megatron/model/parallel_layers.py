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
from megatron.model.sequence_parallel import gather_sequence, reduce_scatter_sequence
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


def sum_gradient_over_sequence_parts(param: torch.nn.Parameter) -> None:
    """Under sequence parallelism a parameter applied to this rank's part of the sequence only (a norm's weight, a
    bias added after the reduce-scatter, a LoRA matrix on a part) gets its part's gradient; the hook sums it over
    the tensor-parallel ranks (Megatron marks such parameters ``sequence_parallel`` and all-reduces them)."""
    param.register_hook(sum_over_tensor_parallel_ranks)


class ColumnParallelLinear(_WithoutExtraState, tensor_parallel.ColumnParallelLinear):
    """With ``sequence_parallel`` the input may come as this rank's part of the sequence (``split``): it is
    all-gathered first, and its gradient reduce-scattered instead of all-reduced (megatron/model/sequence_parallel.py).
    megatron-core's own sequence-parallel linear gathers into GPU buffers, so the gather is done before it."""

    def __init__(self, *args, sequence_parallel: bool = False, **kwargs):
        super().__init__(*args, disable_grad_reduce=sequence_parallel, **kwargs)

    def forward(self, x: torch.Tensor, split: bool = False):
        if self.disable_grad_reduce:
            x = gather_sequence(x) if split else copy_to_tensor_parallel_region(x)
        return super().forward(x)


class RowParallelLinear(_WithoutExtraState, tensor_parallel.RowParallelLinear):
    """With ``split`` the ranks' partial outputs are reduce-scattered along the sequence, not all-reduced, and the
    bias is added to this rank's part (megatron-core's forward with sequence_parallel, its collective chosen by
    the backend in megatron/model/sequence_parallel.py)."""

    def forward(self, x: torch.Tensor, split: bool = False):
        if not split:
            return super().forward(x)
        partial = self._forward_impl(input=x, weight=self.weight, bias=None,
                                     gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                                     allreduce_dgrad=False, sequence_parallel=False, tp_group=None,
                                     grad_output_buffer=None)
        out = reduce_scatter_sequence(partial)
        if self.skip_bias_add:
            return out, self.bias
        return (out if self.bias is None else out + self.bias), None


class VocabParallelEmbedding(_WithoutExtraState, tensor_parallel.VocabParallelEmbedding):
    pass
