"""Rotary position embedding in the GPT-NeoX / Hugging Face "rotate_half" convention.

The first ``rotary_ndims`` dimensions of each head are rotated, the rest pass unchanged; the
frequencies are 1 / base^(2i / rotary_ndims), and the two halves of the rotated dimensions pair up
(dimension j with dimension j + rotary_ndims / 2): with x1, x2 the halves and c, s the cos and sin
of the pair's angle,

    y1 = x1 * c - x2 * s        y2 = x2 * c + x1 * s

which is ``x * cos + rotate_half(x) * sin`` with the same rounding, element for element.

RoPE scaling (``rope_scaling``, megatron/contract/architecture.py) changes the frequencies, and yarn also
scales cos and sin, exactly as transformers' rope init functions (modeling_rope_utils) do; the
llama3 rule and yarn's blend of frequencies are megatron-core's own. megatron-core's linear
interpolation divides the positions instead of the frequencies, which rounds differently, so linear
divides the frequencies as transformers does.

``split_qkv`` takes the fused query/key/value projection apart, rotates queries and keys, and
returns all three as [batch, heads, seq, head_dim]; its backward writes every gradient straight
into one buffer of the fused projection's shape. Built from slices and ``chunk`` instead, autograd
would zero-fill a tensor per slice and concatenate the pieces in the backward pass, which cost
more than the rotation itself on a CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding


def _yarn(inv_freq: torch.Tensor, rotary_ndims: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Yarn's frequencies and the factor on cos and sin (transformers' _compute_yarn_parameters)."""
    factor = scaling["factor"]
    low, high = yarn_rotary_pos_embedding._yarn_find_correction_range(
        scaling.get("beta_fast") or 32.0, scaling.get("beta_slow") or 1.0, rotary_ndims, base,
        scaling["original_max_position_embeddings"], scaling.get("truncate", True))
    extrapolated = 1 - yarn_rotary_pos_embedding._yarn_linear_ramp_mask(low, high, rotary_ndims // 2, inv_freq.device)
    interpolated = 1.0 / (factor * base ** (torch.arange(0, rotary_ndims, 2, dtype=torch.float32) / rotary_ndims))
    blended = interpolated * (1 - extrapolated) + inv_freq * extrapolated
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        both = bool(mscale and mscale_all_dim)  # transformers takes their ratio only when both are non-zero
        attention_factor = yarn_rotary_pos_embedding._yarn_get_concentration_factor(
            factor, mscale if both else None, mscale_all_dim if both else None)
    return blended, float(attention_factor)


def rotary_frequencies(rotary_ndims: int, base: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_ndims / 2], factor on cos and sin) for plain or scaled rotary."""
    plain = rotary_pos_embedding.RotaryEmbedding(rotary_ndims, 1.0, rotary_base=base, use_cpu_initialization=True)
    inv_freq = plain.inv_freq
    rope_type = scaling["rope_type"] if scaling else None
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return plain._apply_scaling(inv_freq, factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                                    high_freq_factor=scaling["high_freq_factor"],
                                    original_max_position_embeddings=scaling["original_max_position_embeddings"]), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, rotary_ndims, base, scaling)
    return inv_freq, 1.0


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rotary_ndims: int, base: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.rotary_ndims = rotary_ndims
        inv_freq, self.attention_factor = rotary_frequencies(rotary_ndims, base, scaling)
        # Not persistent: computed from the settings, so checkpoints hold only parameters.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._prefix_cache: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [batch or 1, seq, rotary_ndims / 2], computed in fp32, returned in ``dtype``."""
        positions = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
        angles = positions[..., None].float() * self.inv_freq.float()
        if self.attention_factor != 1.0:
            return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def cos_sin_for_length(self, seq_len: int, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin`` of positions 0..seq_len-1, computed once and reused by every later step."""
        key = (seq_len, torch.device(device), dtype, self.inv_freq.device)
        if self._prefix_cache is None or self._prefix_cache[0] != key:
            positions = torch.arange(seq_len, device=self.inv_freq.device)
            self._prefix_cache = (key, tuple(t.to(device) for t in self.cos_sin(positions, dtype)))
        return self._prefix_cache[1]


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> None:
    """out = x with its first 2 x cos.shape[-1] dims rotated by +angle (sign 1) or -angle (sign -1)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    torch.mul(x1, cos, out=out[..., :half])
    out[..., :half].sub_(x2 * sin, alpha=sign)
    torch.mul(x2, cos, out=out[..., half:2 * half])
    out[..., half:2 * half].add_(x1 * sin, alpha=sign)
    if x.shape[-1] > 2 * half:
        out[..., 2 * half:].copy_(x[..., 2 * half:])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] with its first 2 x cos.shape[-1] dims rotated, by autograd's own ops (the same
    arithmetic as ``_rotate_into``): for queries and keys that are normalised after ``split_qkv``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def qkv_views(fused: torch.Tensor, heads: int, kv_heads: int, head_dim: int, grouped: bool):
    """q [b, s, heads, d], k and v [b, s, kv_heads, d] as views of ``fused`` [b, s, width].

    Layout: per head [q, k, v] without grouped-query attention; with it, all query heads, then all
    key heads, then all value heads (GPT-NeoX's layouts).
    """
    b, s, _ = fused.shape
    if grouped:
        q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(b, s, heads, head_dim), k.view(b, s, kv_heads, head_dim), v.view(b, s, kv_heads, head_dim)
    per_head = fused.view(b, s, heads, 3, head_dim)
    return per_head[..., 0, :], per_head[..., 1, :], per_head[..., 2, :]


class _SplitQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fused, cos, sin, heads, kv_heads, head_dim, grouped):
        ctx.layout = (heads, kv_heads, head_dim, grouped)
        ctx.save_for_backward(cos, sin)
        outputs = []
        for i, view in enumerate(qkv_views(fused, heads, kv_heads, head_dim, grouped)):
            view = view.transpose(1, 2)
            out = torch.empty(view.shape, dtype=fused.dtype, device=fused.device)
            if cos is not None and i < 2:  # queries and keys
                _rotate_into(out, view, cos.unsqueeze(1), sin.unsqueeze(1), sign=1.0)
            else:
                out.copy_(view)
            outputs.append(out)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        cos, sin = ctx.saved_tensors
        heads, kv_heads, head_dim, grouped = ctx.layout
        reference = next(g for g in grads if g is not None)
        b, _, s, _ = reference.shape
        width = (heads + 2 * kv_heads) * head_dim
        grad_fused = torch.empty((b, s, width), dtype=reference.dtype, device=reference.device)
        views = qkv_views(grad_fused, heads, kv_heads, head_dim, grouped)
        for i, (view, grad) in enumerate(zip(views, grads, strict=True)):
            view = view.transpose(1, 2)
            if grad is None:
                view.zero_()
            elif cos is not None and i < 2:  # the rotation's transpose: rotate back
                _rotate_into(view, grad, cos.unsqueeze(1), sin.unsqueeze(1), sign=-1.0)
            else:
                view.copy_(grad)
        return grad_fused, None, None, None, None, None, None


def split_qkv(
    fused: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    grouped: bool,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[b, s, width] -> q [b, heads, s, d], k and v [b, kv_heads, s, d], contiguous; q and k rotated
    when ``cos_sin`` ([b or 1, s, rotary_ndims / 2] each) is given."""
    cos, sin = cos_sin if cos_sin is not None else (None, None)
    return _SplitQKV.apply(fused, cos, sin, heads, kv_heads, head_dim, grouped)
