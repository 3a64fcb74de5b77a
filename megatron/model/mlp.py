"""The feed-forward block: ``linear1`` -> activation -> ``linear2`` (GPT-NeoX's names).

For swiglu, ``linear1`` holds the up projection then the gate projection stacked along its output
dimension (per tensor-parallel partition), and the activation is silu(gate) * up (Llama's MLP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.model.architecture import Architecture
from megatron.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    model_parallel_config,
)

_ACTIVATIONS = {
    "gelu": F.gelu,  # exact (erf) GELU, Hugging Face GPTNeoX's "gelu"
    "relu": F.relu,
    "silu": F.silu,
}


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


class MLP(torch.nn.Module):
    def __init__(self, arch: Architecture, init_method, output_init_method):
        super().__init__()
        config = model_parallel_config()
        gated = arch.activation == "swiglu"
        self.activation = swiglu if gated else _ACTIVATIONS[arch.activation]
        self.linear1 = ColumnParallelLinear(
            arch.hidden_size,
            (2 if gated else 1) * arch.intermediate_size,
            config=config,
            init_method=init_method,
            bias=arch.bias_in_mlp,
            gather_output=False,
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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        inner, _ = self.linear1(hidden)
        out, _ = self.linear2(self.activation(inner))
        return out
