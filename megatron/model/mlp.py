"""The feed-forward block: ``linear1`` -> activation -> ``linear2`` (GPT-NeoX's names).

Widths follow GPT-NeoX's rule (megatron/contract/architecture.py). For swiglu, ``linear1`` holds the up
projection then the gate projection stacked along its output dimension (per tensor-parallel
partition), and the activation is silu(gate) * up (GPT-NeoX's gated activation, Llama's MLP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.contract.architecture import GELU_EXACT, GELU_ONNX_ERF, GELU_TANH, Architecture
from megatron.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    model_parallel_config,
)


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _onnx_erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's onnx_safe GELU: the erf form with 1.41421 where exact GELU has sqrt(2)."""
    return x * 0.5 * (torch.erf(x / 1.41421) + 1.0)


_GELUS = {GELU_EXACT: F.gelu, GELU_TANH: _tanh_gelu, GELU_ONNX_ERF: _onnx_erf_gelu}
_ACTIVATIONS = {"relu": F.relu, "silu": F.silu}


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of ``linear1``'s output [..., up | gate]. The backward writes both halves'
    gradients into one buffer; through ``chunk`` autograd would concatenate them instead."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        up, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        up, gate = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_up, grad_gate = grad_x.chunk(2, dim=-1)
        torch.mul(grad, F.silu(gate), out=grad_up)
        grad_gate.copy_(torch.ops.aten.silu_backward(grad * up, gate))
        return grad_x


def swiglu(x: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(x)


def elementwise_activation(arch: Architecture):
    """The activation applied element by element: the model's, or for swiglu the gate's (silu)."""
    if arch.activation == "gelu":
        return _GELUS[arch.gelu_approximation]
    return F.silu if arch.gated else _ACTIVATIONS[arch.activation]


class MLP(torch.nn.Module):
    def __init__(self, arch: Architecture, init_method, output_init_method):
        super().__init__()
        config = model_parallel_config()
        self.activation = swiglu if arch.gated else elementwise_activation(arch)
        self.linear1 = ColumnParallelLinear(
            arch.hidden_size,
            arch.linear1_width,
            config=config,
            init_method=init_method,
            bias=arch.bias_in_mlp,
            gather_output=False,
            sequence_parallel=arch.splits_sequence,
        )
        self.linear2 = RowParallelLinear(
            arch.intermediate_size,
            arch.hidden_size,
            config=config,
            init_method=output_init_method,
            bias=arch.bias_in_mlp,
            input_is_parallel=True,
            skip_bias_add=False,
        )

    def forward(self, hidden: torch.Tensor, split: bool = False) -> torch.Tensor:
        """With ``split`` ``hidden`` and the output are this rank's part of the sequence (TransformerLayer)."""
        inner, _ = self.linear1(hidden, split)
        out, _ = self.linear2(self.activation(inner), split)
        return out
