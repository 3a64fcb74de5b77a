"""Rotary position embedding in the GPT-NeoX / Hugging Face "rotate_half" convention.

The first ``rotary_ndims`` dimensions of each head are rotated, the rest pass unchanged; the
frequencies are 1 / base^(2i / rotary_ndims), and the two halves of the rotated dimensions pair up
(dimension j with dimension j + rotary_ndims / 2).
"""

from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rotary_ndims: int, base: float):
        super().__init__()
        self.rotary_ndims = rotary_ndims
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_ndims, 2, dtype=torch.float32) / rotary_ndims))
        # Not persistent: computed from the settings, so checkpoints hold only parameters.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [batch or 1, seq, rotary_ndims], computed in fp32, returned in ``dtype``."""
        positions = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
        freqs = positions[..., None].float() * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading cos.shape[-1] dims of ``x`` [batch, heads, seq, head_dim]; cos/sin are [b, s, r]."""
    ndims = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated, passed = x[..., :ndims], x[..., ndims:]
    rotated = rotated * cos + rotate_half(rotated) * sin
    return torch.cat((rotated, passed), dim=-1)
