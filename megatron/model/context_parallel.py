"""Context parallelism: each sequence split over the context-parallel ranks, attention exact across the split.

Contract. With ``context_parallel_size`` C > 1 the model takes the whole sequence of s tokens on every rank of a
context-parallel group (they read the same samples) and computes only this rank's tokens: the sequence is cut
into 2C chunks of s / 2C tokens and rank i holds chunks i and 2C - 1 - i, in that order (Megatron's load-balanced
causal split: every rank holds as many early as late queries, so the causal attention costs each rank the
same). ``ContextParallelSplit.own`` takes this rank's tokens of any [b, s, ...] tensor along the sequence (the
inputs, their positions, the targets and loss mask); every token keeps its global position, so RoPE and learned
positions are those of the whole sequence.

Attention: each layer all-gathers the keys and values of the group and puts them back in sequence order
(``gather_keys_values``); its backward sums each rank's key/value gradients over the group and keeps this
rank's tokens (a reduce-scatter). The queries are this rank's; the mask of its rows (``query_mask``) comes from
the global query and key indices: causal, within the sliding window where there is one, and the rows of a
packed batch's block-causal mask. A ring of key/value blocks would hold less at once; the all-gather is one
collective per layer and exact.

Loss (``whole_sequence_loss``): each rank's loss is the sum of its tokens' losses divided by the trained tokens
of the whole sequence (all ranks' count), so the ranks' gradients sum to the sequence's gradient. DeepSpeed
sums the gradients over the context-parallel ranks (megatron/runtime/initialize.py, ModelParallelUnit); the
value each rank returns is the whole sequence's loss, so every rank reports the loss of one rank's run. DPO
instead needs each sequence's sum of log-probabilities: ``whole_sequence_values`` gives every rank the whole
sequence's per-token values (an all-reduce of each rank's tokens' values, zero elsewhere) and passes the
gradient back unchanged, so every rank computes the whole loss and the ranks' gradients again sum to its gradient.

On NCCL the reduce-scatter is NCCL's; gloo has none, so there it is an all-reduce followed by keeping this
rank's slice (the same sums, twice the traffic).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from megatron.ranks import context_parallel_rank_and_size


def _group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def own_token_indices(seq_len: int, size: int, rank: int) -> torch.Tensor:
    """The global indices of the tokens context-parallel rank ``rank`` of ``size`` holds, in its order."""
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))


@lru_cache(maxsize=16)
def _sequence_order(seq_len: int, size: int) -> torch.Tensor:
    """Where each token of the sequence sits in the ranks' parts concatenated in rank order."""
    gathered = torch.cat([own_token_indices(seq_len, size, rank) for rank in range(size)])
    return torch.argsort(gathered)


def _all_gather(part: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(part) for _ in range(context_parallel_rank_and_size()[1])]
    torch.distributed.all_gather(parts, part.contiguous(), group=_group())
    return torch.cat(parts, dim=dim)


def _reduce_scatter(whole: torch.Tensor, dim: int) -> torch.Tensor:
    rank, size = context_parallel_rank_and_size()
    if torch.distributed.get_backend(_group()) == "nccl":
        pieces = [piece.contiguous() for piece in whole.chunk(size, dim=dim)]
        out = torch.empty_like(pieces[rank])
        torch.distributed.reduce_scatter(out, pieces, group=_group())
        return out
    total = whole.contiguous().clone()
    torch.distributed.all_reduce(total, group=_group())
    return total.chunk(size, dim=dim)[rank].contiguous()


class _GatherParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _all_gather(part, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim), None


def gather_keys_values(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys and values [b, heads, s / C, d] of this rank's tokens -> [b, heads, s, d] of the whole sequence in
    sequence order, gathered in one collective."""
    local = keys.shape[2]
    size = context_parallel_rank_and_size()[1]
    whole = _GatherParts.apply(torch.stack((keys, values)), 3)
    order = _sequence_order(local * size, size).to(whole.device)
    whole = whole.index_select(3, order)
    return whole[0], whole[1]


@dataclass(frozen=True)
class ContextParallelSplit:
    """This rank's share of one forward's sequence of ``seq_len`` tokens."""

    seq_len: int
    indices: torch.Tensor  # [s / C] the global indices of this rank's tokens, in its order

    @classmethod
    def of_this_rank(cls, seq_len: int, device: torch.device) -> ContextParallelSplit:
        rank, size = context_parallel_rank_and_size()
        return cls(seq_len, own_token_indices(seq_len, size, rank).to(device))

    def own(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``whole`` [b, s, ...] (or [s]) along the sequence."""
        return whole.index_select(1 if whole.dim() > 1 else 0, self.indices)

    def query_mask(self, attention_mask: torch.Tensor | None, sliding_window_width: int | None) -> torch.Tensor | None:
        """[b or 1, 1, s / C, s] booleans, True where this rank's query may see a key of the whole sequence:
        at or before it, at most ``sliding_window_width`` back, and where ``attention_mask`` [b, 1, s, s] allows.
        None where that is plain causal attention (no mask, no window shorter than the sequence): then
        ``causal_chunk_attention`` runs it without a mask."""
        if attention_mask is None and (sliding_window_width is None or sliding_window_width >= self.seq_len - 1):
            return None
        distance = self.indices[:, None] - torch.arange(self.seq_len, device=self.indices.device)[None, :]
        allowed = distance >= 0
        if sliding_window_width is not None:
            allowed = allowed & (distance <= sliding_window_width)
        allowed = allowed[None, None]
        return allowed if attention_mask is None else attention_mask.index_select(2, self.indices) & allowed


def causal_chunk_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           **attention) -> torch.Tensor:
    """Causal attention of this rank's queries [b, h, s / C, d] (its two chunks, in its order) over the whole
    sequence's keys and values [b, h_kv, s, d]: each chunk attends to the keys up to its own end, causal aligned
    at the lower right, so torch's fused kernels run it without a mask of s / C x s booleans (on a CPU such a mask
    cost 6x the memory of the whole sequence's causal attention). ``attention``: scaled_dot_product_attention's
    other arguments."""
    from torch.nn.attention.bias import causal_lower_right

    rank, size = context_parallel_rank_and_size()
    chunk = queries.shape[2] // 2
    parts = []
    for part, index in enumerate((rank, 2 * size - 1 - rank)):
        end = (index + 1) * chunk
        parts.append(F.scaled_dot_product_attention(
            queries[:, :, part * chunk:(part + 1) * chunk], keys[:, :, :end], values[:, :, :end],
            attn_mask=causal_lower_right(chunk, end), **attention))
    return torch.cat(parts, dim=2)


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum over the context-parallel ranks. Backward: the gradient as it is, for every rank computes
    the same loss from the sum and DeepSpeed sums the ranks' gradients."""

    @staticmethod
    def forward(ctx, part: torch.Tensor) -> torch.Tensor:
        total = part.contiguous().clone()
        torch.distributed.all_reduce(total, group=_group())
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def whole_sequence_values(own_values: torch.Tensor, share: ContextParallelSplit) -> torch.Tensor:
    """[b, s] per-token values of the whole sequence on every rank, from this rank's tokens' [b, s / C] (DPO's and
    KTO's log-probabilities, whose per-sequence sums need every token); the gradient reaches this rank's tokens."""
    whole = own_values.new_zeros(own_values.shape[0], share.seq_len).index_copy(1, share.indices, own_values)
    return _SumOverRanks.apply(whole)


def whole_sequence_loss(local_sum: torch.Tensor, local_count: torch.Tensor) -> torch.Tensor:
    """The loss of a sequence split over the context-parallel ranks from this rank's sum of token losses and count
    of trained tokens: its value is the whole sequence's mean (every rank the same), its gradient this rank's
    share, local_sum / the whole count."""
    totals = torch.stack((local_sum.detach().float(), local_count.detach().float()))
    torch.distributed.all_reduce(totals, group=_group())
    count = totals[1].clamp(min=1.0)  # nothing to train anywhere: 0, not 0 / 0
    share = local_sum / count
    return share + (totals[0] / count - share.detach())
