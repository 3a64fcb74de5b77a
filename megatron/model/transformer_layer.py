"""One pre-norm decoder layer, with GPT-NeoX's sequential or parallel (GPT-J) residual."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.contract.architecture import Architecture
from megatron.model.attention import SelfAttention
from megatron.model.kv_cache import LayerKeysValues
from megatron.model.mlp import MLP
from megatron.model.moe import MixtureOfExperts, Routing
from megatron.model.norms import build_norm


class TransformerLayer(torch.nn.Module):
    """sequential: h = x + attn(ln1(x)); out = h + mlp(ln2(h)).
    parallel (gpt_j_residual): out = x + attn(ln1(x)) + mlp(ln2(x)).
    Dropout (hidden_dropout) applies to each branch output before it is added.
    With ``experts`` the MLP is a mixture of experts (megatron/model/moe.py).
    """

    def __init__(self, arch: Architecture, init_method, output_init_method, experts: bool = False):
        super().__init__()
        self.parallel_residual = arch.parallel_residual
        self.hidden_dropout = arch.hidden_dropout
        self.input_layernorm = build_norm(arch.norm, arch.hidden_size, arch.norm_epsilon, arch.bias_in_norms)
        self.attention = SelfAttention(arch, init_method, output_init_method)
        self.post_attention_layernorm = build_norm(
            arch.norm, arch.hidden_size, arch.norm_epsilon, arch.bias_in_norms
        )
        self.mlp = (MixtureOfExperts(arch, init_method, output_init_method) if experts
                    else MLP(arch, init_method, output_init_method))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, p=self.hidden_dropout, training=self.training)

    def forward(
        self,
        x: torch.Tensor,
        rotary_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: LayerKeysValues | None = None,
        routing: list[Routing] | None = None,
    ) -> torch.Tensor:
        """``routing``: where an expert layer appends its router's logits and choices (megatron/model/moe.py)."""
        attn_out = self._dropout(self.attention(self.input_layernorm(x), rotary_cos_sin, attention_mask, kv_cache))
        if self.parallel_residual:
            mlp_out = self._dropout(self._mlp(self.post_attention_layernorm(x), routing))
            return x + attn_out + mlp_out
        hidden = x + attn_out
        return hidden + self._dropout(self._mlp(self.post_attention_layernorm(hidden), routing))

    def _mlp(self, x: torch.Tensor, routing: list[Routing] | None) -> torch.Tensor:
        return self.mlp(x, routing) if isinstance(self.mlp, MixtureOfExperts) else self.mlp(x)
