"""Causal self-attention with a fused query/key/value projection laid out as GPT-NeoX lays it out.

Layout of ``query_key_value``'s output (per tensor-parallel partition):
- num_kv_heads == num_attention_heads: per head [q, k, v], i.e. viewed as heads x 3 x head_dim;
- num_kv_heads < num_attention_heads (grouped-query attention): all query heads, then all key
  heads, then all value heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.architecture import Architecture
from megatron.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    model_parallel_config,
    tensor_parallel_size,
)
from megatron.model.rotary import split_qkv


def sliding_window_mask(seq_len: int, width: int, device: torch.device | None = None) -> torch.Tensor:
    """[seq, seq] booleans, True where query i may attend key j: i - width <= j <= i.

    GPT-NeoX's sliding_window_width is flash-attention's causal window_size=(width, ...): a query
    sees itself and the `width` keys before it.
    """
    positions = torch.arange(seq_len, device=device)
    distance = positions[:, None] - positions[None, :]
    return (distance >= 0) & (distance <= width)


class SelfAttention(torch.nn.Module):
    def __init__(self, arch: Architecture, init_method, output_init_method):
        super().__init__()
        tp = tensor_parallel_size()
        config = model_parallel_config()
        self.head_dim = arch.head_dim
        self.heads = arch.num_attention_heads // tp
        self.kv_heads = arch.num_kv_heads // tp
        self.grouped_layout = arch.num_kv_heads < arch.num_attention_heads
        self.dropout = arch.attention_dropout
        self.sliding_window_width = arch.sliding_window_width
        fused_width = (arch.num_attention_heads + 2 * arch.num_kv_heads) * arch.head_dim
        self.query_key_value = ColumnParallelLinear(
            arch.hidden_size,
            fused_width,
            config=config,
            init_method=init_method,
            bias=arch.bias_in_attn_linear,
            gather_output=False,
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

    def forward(
        self, hidden: torch.Tensor, rotary_cos_sin: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        fused, _ = self.query_key_value(hidden)
        q, k, v = split_qkv(fused, self.heads, self.kv_heads, self.head_dim, self.grouped_layout, rotary_cos_sin)
        window = None
        if self.sliding_window_width is not None and self.sliding_window_width < q.shape[2] - 1:
            window = sliding_window_mask(q.shape[2], self.sliding_window_width, q.device)
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=window,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=window is None,
            scale=self.head_dim**-0.5,
            enable_gqa=self.kv_heads != self.heads,
        )
        b, _, s, _ = context.shape
        context = context.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        out, _ = self.dense(context)
        return out
