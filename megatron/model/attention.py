"""Causal self-attention with a fused query/key/value projection laid out as GPT-NeoX lays it out.

Layout of ``query_key_value``'s output (per tensor-parallel partition):
- num_kv_heads == num_attention_heads: per head [q, k, v], i.e. viewed as heads x 3 x head_dim;
- num_kv_heads < num_attention_heads (grouped-query attention): all query heads, then all key
  heads, then all value heads.

With ``qk_layernorm`` each head's query and key are normalised (one weight for queries, one for
keys, over the head's width) before they are rotated. A tensor-parallel rank normalises only its own
heads with these replicated weights, so their gradients are summed over the tensor-parallel group.
With ``qk_layernorm_across_heads`` (OLMoE) instead all heads' queries are normalised together, as one vector as
wide as the query projection, and all heads' keys likewise. Split over tensor-parallel ranks, each rank holds its
heads' slice of that vector and of the norm's weight, and the mean of squares is summed over the ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.contract.architecture import Architecture
from megatron.model.context_parallel import causal_chunk_attention, gather_keys_values
from megatron.model.kv_cache import LayerKeysValues
from megatron.model.norms import RMSNormOverTensorParallelRanks, build_norm
from megatron.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    model_parallel_config,
    sum_over_ranks_sharing_a_slot,
    sum_over_tensor_parallel_ranks,
)
from megatron.model.rotary import rotate, split_qkv
from megatron.ranks import tensor_parallel_rank, tensor_parallel_size


def query_key_value_rows(arch: Architecture, size: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of ``query_key_value`` that hold the queries, the keys and the values, each in the order of the
    separate projection's rows: of the whole layer at tensor-parallel size 1, of any one rank's part at a larger
    ``size`` (every rank's part is laid out alike, over its own heads; SelfAttention splits them)."""
    heads, kv_heads, head_dim = arch.num_attention_heads // size, max(arch.num_kv_heads // size, 1), arch.head_dim
    if arch.num_kv_heads < arch.num_attention_heads:
        return tuple(torch.arange((heads + 2 * kv_heads) * head_dim).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]))
    per_head = torch.arange(3 * heads * head_dim).reshape(heads, 3, head_dim)
    return tuple(per_head[:, part].reshape(-1) for part in range(3))


def sliding_window_mask(seq_len: int, width: int | None, device: torch.device | None = None,
                        past: int = 0) -> torch.Tensor:
    """[seq, past + seq] booleans, True where query i may attend key j: i - width <= j <= i.

    GPT-NeoX's sliding_window_width is flash-attention's causal window_size=(width, ...): a query
    sees itself and the `width` keys before it (every key before it when `width` is None). With
    `past` cached tokens the queries are at positions past .. past + seq - 1.
    """
    queries = torch.arange(past, past + seq_len, device=device)
    distance = queries[:, None] - torch.arange(past + seq_len, device=device)[None, :]
    allowed = distance >= 0
    return allowed if width is None else allowed & (distance <= width)


def attention_path(arch: Architecture, block_causal: bool) -> str:
    """The start-up line saying how attention runs: always torch's scaled_dot_product_attention (PyTorch picks its
    kernel: FlashAttention or memory-efficient on a GPU, its fused CPU kernel or the math path on a CPU); causal by
    ``is_causal`` unless a mask is needed. A mask rules FlashAttention out on a GPU; no varlen kernel is used."""
    masks = []
    if block_causal:
        masks.append("block-causal per packed document (reset_attention_mask), a [batch, 1, seq, seq] boolean mask")
    if arch.sliding_window_width is not None:
        masks.append(f"a sliding window of {arch.sliding_window_width} keys where the sequence is longer")
    line = "attention: torch scaled_dot_product_attention, " + ("; ".join(masks) if masks else "causal (is_causal)")
    if arch.context_parallel_size > 1:
        line += (f"; context parallel: each sequence split over {arch.context_parallel_size} ranks (load-balanced "
                 "causal chunks), keys and values all-gathered, each chunk causal over the keys up to its end "
                 "(a mask of each rank's query rows where one is needed)")
    if arch.splits_sequence:
        line += (f"; sequence parallel: the residual stream split over {arch.model_parallel_size} tensor-parallel "
                 "ranks, gathered before attention and the MLP")
    return line


def _across_heads(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm`` over all heads of x [b, heads, s, d] together, as one vector of the projection's order per token."""
    b, heads, s, d = x.shape
    return norm(x.transpose(1, 2).reshape(b, s, heads * d)).reshape(b, s, heads, d).transpose(1, 2)


class SelfAttention(torch.nn.Module):
    def __init__(self, arch: Architecture, init_method, output_init_method):
        super().__init__()
        tp = tensor_parallel_size()
        config = model_parallel_config()
        self.head_dim = arch.head_dim
        self.heads = arch.num_attention_heads // tp
        self.kv_heads = max(arch.num_kv_heads // tp, 1)  # fewer heads than ranks: one, replicated
        self.grouped_layout = arch.num_kv_heads < arch.num_attention_heads
        self.dropout = arch.attention_dropout
        self.sliding_window_width = arch.sliding_window_width
        self.context_parallel = arch.context_parallel_size > 1
        # megatron-core gives each rank fused_width / tp: its query heads and its key and value heads
        fused_width = (arch.num_attention_heads + 2 * max(arch.num_kv_heads, tp)) * arch.head_dim
        self.query_key_value = ColumnParallelLinear(
            arch.hidden_size,
            fused_width,
            config=config,
            init_method=init_method,
            bias=arch.qkv_bias,
            gather_output=False,
            sequence_parallel=arch.splits_sequence,
        )
        self.dense = RowParallelLinear(
            arch.num_attention_heads * arch.head_dim,
            arch.hidden_size,
            config=config,
            init_method=output_init_method,
            bias=arch.bias_in_attn_linear,
            input_is_parallel=True,
            skip_bias_add=False,
        )
        self.q_layernorm = self.k_layernorm = None
        self.qk_norm_across_heads = arch.qk_layernorm_across_heads
        if arch.qk_layernorm_across_heads:
            if tp > 1:  # an RMSNorm (query_key_norm_problem); each rank holds its heads' slice
                self.q_layernorm = RMSNormOverTensorParallelRanks(self.heads * arch.head_dim, arch.norm_epsilon)
                self.k_layernorm = RMSNormOverTensorParallelRanks(self.kv_heads * arch.head_dim, arch.norm_epsilon)
            else:
                self.q_layernorm = build_norm(arch.norm, self.heads * arch.head_dim, arch.norm_epsilon,
                                              arch.bias_in_norms)
                self.k_layernorm = build_norm(arch.norm, self.kv_heads * arch.head_dim, arch.norm_epsilon,
                                              arch.bias_in_norms)
        if arch.qk_layernorm:
            self.q_layernorm = build_norm(arch.norm, arch.head_dim, arch.norm_epsilon, arch.bias_in_norms)
            self.k_layernorm = build_norm(arch.norm, arch.head_dim, arch.norm_epsilon, arch.bias_in_norms)
            if tp > 1:
                for norm in (self.q_layernorm, self.k_layernorm):
                    for param in norm.parameters():
                        param.register_hook(sum_over_tensor_parallel_ranks)
        self.num_kv_heads = arch.num_kv_heads
        if arch.num_kv_heads < tp:
            self.shared_kv_head = tensor_parallel_rank() * arch.num_kv_heads // tp
            for param in self.query_key_value.parameters():
                param.register_hook(self._sum_shared_key_value_gradient)

    def _sum_shared_key_value_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of the replicated key/value head summed over the ranks holding it.

        Each of those ranks backpropagates only its own query heads through the head; the input's
        gradient already sums every rank's share over the tensor-parallel group, the head's own does not.
        """
        query_rows = self.heads * self.head_dim
        shared = sum_over_ranks_sharing_a_slot(grad[query_rows:], self.shared_kv_head, self.num_kv_heads)
        return torch.cat((grad[:query_rows], shared))

    def forward(
        self,
        hidden: torch.Tensor,
        rotary_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: LayerKeysValues | None = None,
        split: bool = False,
    ) -> torch.Tensor:
        """``attention_mask`` [b, 1, s, s] (True: may attend) replaces the causal mask; it must be causal itself.
        With ``split`` ``hidden`` and the output are this rank's part of the sequence (TransformerLayer).

        With `kv_cache`, `hidden` holds the tokens after the cached ones, which they attend to as well.
        """
        fused, _ = self.query_key_value(hidden, split)
        if self.q_layernorm is None:
            q, k, v = split_qkv(fused, self.heads, self.kv_heads, self.head_dim, self.grouped_layout, rotary_cos_sin)
        else:
            q, k, v = split_qkv(fused, self.heads, self.kv_heads, self.head_dim, self.grouped_layout, None)
            if self.qk_norm_across_heads:
                q, k = _across_heads(self.q_layernorm, q), _across_heads(self.k_layernorm, k)
            else:
                q, k = self.q_layernorm(q), self.k_layernorm(k)
            if rotary_cos_sin is not None:
                q, k = rotate(q, *rotary_cos_sin), rotate(k, *rotary_cos_sin)
        past = 0
        if kv_cache is not None:
            past = kv_cache.length
            k, v = kv_cache.extend(k, v)
        mask = attention_mask
        attention = dict(dropout_p=self.dropout if self.training else 0.0, scale=self.head_dim**-0.5,
                         enable_gqa=self.kv_heads != self.heads)
        if self.context_parallel:  # a mask holds this rank's rows, window included (GPTModel); none: causal
            k, v = gather_keys_values(k, v)
            context = (causal_chunk_attention(q, k, v, **attention) if mask is None
                       else F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **attention))
        else:
            # with cached keys is_causal would align the queries with the first keys, not the last
            if past or (self.sliding_window_width is not None and self.sliding_window_width < q.shape[2] - 1):
                window = sliding_window_mask(q.shape[2], self.sliding_window_width, q.device, past)
                mask = window if mask is None else mask & window
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **attention)
        b, _, s, _ = context.shape
        context = context.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        out, _ = self.dense(context, split)
        return out
