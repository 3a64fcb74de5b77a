"""LayerNorm (GPT-NeoX/Pythia) and RMSNorm (Llama), both computed in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.model.parallel_layers import sum_over_tensor_parallel_ranks_and_back
from megatron.ranks import tensor_parallel_size


class LayerNorm(torch.nn.Module):
    """Parameters ``weight`` and, with ``bias=True``, ``bias`` (GPT-NeoX's names)."""

    def __init__(self, hidden_size: int, eps: float, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), bias, self.eps)
        return out.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """Llama's RMSNorm: x / sqrt(mean(x^2) + eps), then the ``scale`` (GPT-NeoX's name for the weight).

    Like Hugging Face's LlamaRMSNorm the normalisation runs in fp32 and is cast back to the input
    dtype before the scale multiplies it. (GPT-NeoX's own RMSNorm multiplies by the scale in fp32 and
    casts afterwards; in fp32 the two are the same, in bf16/fp16 they round differently, and we follow
    Llama so converted Llama weights give Llama's outputs.)
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = torch.nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(self.mean_of_squares(x32) + self.eps)
        return self.scale * normed.to(x.dtype)

    def mean_of_squares(self, x32: torch.Tensor) -> torch.Tensor:
        return x32.pow(2).mean(-1, keepdim=True)


class RMSNormOverTensorParallelRanks(RMSNorm):
    """An RMSNorm over vectors whose slices the tensor-parallel ranks hold, each rank its slice's ``scale``: the mean
    of squares is the whole vector's (OLMoE's query/key norm across heads, each rank holding its heads)."""

    def mean_of_squares(self, x32: torch.Tensor) -> torch.Tensor:
        total = sum_over_tensor_parallel_ranks_and_back(x32.pow(2).sum(-1, keepdim=True))
        return total / (x32.shape[-1] * tensor_parallel_size())


def build_norm(kind: str, hidden_size: int, eps: float, bias: bool) -> torch.nn.Module:
    if kind == "rmsnorm":
        return RMSNorm(hidden_size, eps)
    return LayerNorm(hidden_size, eps, bias=bias)


NORM_TYPES = (LayerNorm, RMSNorm)
