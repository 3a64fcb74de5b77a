"""Megatron's sequence parallelism over the model's [batch, sequence, hidden] activations.

With ``sequence_parallel`` at a tensor-parallel size above 1, each tensor-parallel rank holds 1/size of the
sequence of the residual stream: the norms, the residual additions and hidden dropout run on that part only.
Before a column-parallel layer the parts are all-gathered (its backward reduce-scatters the gradient), after a
row-parallel layer the partial sums are reduce-scattered (its backward all-gathers), the embedding's output is
split and the final norm's output all-gathered before the output layer (docs/architecture.md).

On NCCL the collectives are megatron-core's own mappings (megatron.core.tensor_parallel.mappings), which split
and join the first dimension, so the sequence is moved to the front around them. megatron-core's mappings put
their buffers on the GPU and gloo has no reduce-scatter, so on CPU ranks (gloo) the same autograd rules run
here: the all-gather through ``all_gather`` into a list, the reduce-scatter as an ``all_reduce`` followed by
keeping this rank's slice (twice the traffic of a reduce-scatter, the same sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel import mappings
from megatron.ranks import tensor_parallel_rank, tensor_parallel_size

SEQUENCE_DIM = 1


def _group():
    return parallel_state.get_tensor_model_parallel_group()


def uses_megatron_core_collectives() -> bool:
    """Whether the tensor-parallel group's backend runs megatron-core's mappings (NCCL); else the gloo path."""
    return torch.distributed.get_backend(_group()) == "nccl"


def own_part(whole: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the sequence of a tensor every tensor-parallel rank holds whole."""
    return whole.chunk(tensor_parallel_size(), dim=SEQUENCE_DIM)[tensor_parallel_rank()].contiguous()


def _all_gather(part: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(part) for _ in range(tensor_parallel_size())]
    torch.distributed.all_gather(parts, part.contiguous(), group=_group())
    return torch.cat(parts, dim=SEQUENCE_DIM)


def _reduce_scatter(partial: torch.Tensor) -> torch.Tensor:
    total = partial.contiguous().clone()
    torch.distributed.all_reduce(total, group=_group())
    return own_part(total)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: torch.Tensor, gradient_is_replicated: bool) -> torch.Tensor:
        ctx.gradient_is_replicated = gradient_is_replicated
        return _all_gather(part)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (own_part(grad) if ctx.gradient_is_replicated else _reduce_scatter(grad)), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: torch.Tensor) -> torch.Tensor:
        return _reduce_scatter(partial)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _all_gather(grad)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole: torch.Tensor) -> torch.Tensor:
        return own_part(whole)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _all_gather(grad)


def _swap_batch_and_sequence(x: torch.Tensor) -> torch.Tensor:
    """[b, s, ...] <-> [s, b, ...], contiguous (megatron-core's linear layers view their input)."""
    return x.transpose(0, SEQUENCE_DIM).contiguous()


def gather_sequence(part: torch.Tensor, gradient_is_replicated: bool = False) -> torch.Tensor:
    """The whole sequence from every rank's part. The backward reduce-scatters the gradient (each rank's is a
    partial sum, as a column-parallel layer's input gradient is), or with ``gradient_is_replicated`` (every rank
    already holds the whole gradient) keeps this rank's slice of it."""
    if uses_megatron_core_collectives():
        whole = mappings.gather_from_sequence_parallel_region(
            _swap_batch_and_sequence(part), tensor_parallel_output_grad=not gradient_is_replicated)
        return _swap_batch_and_sequence(whole)
    return _Gather.apply(part, gradient_is_replicated)


def reduce_scatter_sequence(partial: torch.Tensor) -> torch.Tensor:
    """This rank's part of the sequence of the sum of every rank's ``partial``; the backward all-gathers."""
    if uses_megatron_core_collectives():
        return _swap_batch_and_sequence(
            mappings.reduce_scatter_to_sequence_parallel_region(_swap_batch_and_sequence(partial)))
    return _ReduceScatter.apply(partial)


def scatter_sequence(whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of the sequence of a tensor every rank holds whole; the backward all-gathers."""
    if uses_megatron_core_collectives():
        return _swap_batch_and_sequence(mappings.scatter_to_sequence_parallel_region(_swap_batch_and_sequence(whole)))
    return _Scatter.apply(whole)


def dropout_of_part(part: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout on this rank's part of the sequence with this part's slice of the mask the whole sequence draws, so
    the steps are those of the same run without sequence parallelism (every tensor-parallel rank draws from the
    same random state, as they do there)."""
    if not training or p == 0.0:
        return part
    shape = list(part.shape)
    shape[SEQUENCE_DIM] *= tensor_parallel_size()
    return part * own_part(F.dropout(part.new_ones(shape), p=p, training=True))
