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
from megatron.model.parallel_layers import sum_gradient_over_sequence_parts
from megatron.model.sequence_parallel import dropout_of_part


class TransformerLayer(torch.nn.Module):
    """sequential: h = x + attn(ln1(x)); out = h + mlp(ln2(h)).
    parallel (gpt_j_residual): out = x + attn(ln1(x)) + mlp(ln2(x)).
    Dropout (hidden_dropout) applies to each branch output before it is added.
    With ``experts`` the MLP is a mixture of experts (megatron/model/moe.py).
    With ``split`` (sequence parallelism) x and the output are this tensor-parallel rank's part of the sequence
    (megatron/model/sequence_parallel.py): the norms, dropout and residual run on it, attention and the MLP
    gather the whole sequence in their column-parallel layers and reduce-scatter it after their row-parallel ones.
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
        if arch.splits_sequence:
            for param in self._parameters_on_sequence_parts():
                sum_gradient_over_sequence_parts(param)

    def _parameters_on_sequence_parts(self) -> list[torch.nn.Parameter]:
        """The norms' weights and the row-parallel layers' biases, which a split sequence applies to a part."""
        params = [*self.input_layernorm.parameters(), *self.post_attention_layernorm.parameters()]
        row_parallel = [self.attention.dense] + ([] if isinstance(self.mlp, MixtureOfExperts) else [self.mlp.linear2])
        return params + [layer.bias for layer in row_parallel if layer.bias is not None]

    def _dropout(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        if split:
            return dropout_of_part(x, self.hidden_dropout, self.training)
        return F.dropout(x, p=self.hidden_dropout, training=self.training)

    def forward(
        self,
        x: torch.Tensor,
        rotary_cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: LayerKeysValues | None = None,
        routing: list[Routing] | None = None,
        split: bool = False,
    ) -> torch.Tensor:
        """``routing``: where an expert layer appends its router's logits and choices (megatron/model/moe.py)."""
        attention = self.attention(self.input_layernorm(x), rotary_cos_sin, attention_mask, kv_cache, split)
        attn_out = self._dropout(attention, split)
        if self.parallel_residual:
            mlp_out = self._dropout(self._mlp(self.post_attention_layernorm(x), routing, split), split)
            return x + attn_out + mlp_out
        hidden = x + attn_out
        return hidden + self._dropout(self._mlp(self.post_attention_layernorm(hidden), routing, split), split)

    def _mlp(self, x: torch.Tensor, routing: list[Routing] | None, split: bool) -> torch.Tensor:
        return self.mlp(x, routing, split) if isinstance(self.mlp, MixtureOfExperts) else self.mlp(x, split)
