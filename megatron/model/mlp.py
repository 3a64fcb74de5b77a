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


def swiglu(x: torch.Tensor) -> torch.Tensor:
    up, gate = x.chunk(2, dim=-1)
    return F.silu(gate) * up


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
