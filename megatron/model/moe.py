"""A mixture-of-experts layer in place of the MLP: top-k routing, dropless, as Hugging Face computes it.

Names and layout are GPT-NeoX's (``ParallelDroplessMoE``): the router ``router.layer`` (hidden ->
experts, no bias) and the experts' weights stacked along their first dimension, each expert's rows
together: ``experts.mlp.w1`` [experts x width, hidden] (for swiglu the gate), ``experts.mlp.w3`` (swiglu
only: the up projection) and ``experts.mlp.w2`` [experts x width, hidden], the down projection
transposed. What each token gets (megatron/architecture.py) follows transformers' Mixtral and Qwen3-MoE
step by step, so its numbers are theirs: the router's logits in the model's dtype, their softmax in
fp32, the ``top_k`` largest probabilities (renormalised with ``norm_topk_prob``) weighing the outputs
of the chosen experts, which are added up expert by expert in ascending order. No token is dropped.

The experts run one after the other on the tokens routed to each (a plain-PyTorch grouped computation
that runs anywhere): megatron-core's MoE layer needs its CUDA kernels and token dispatchers for the same.

``load_balancing_loss`` is transformers' ``load_balancing_loss_func`` (Switch Transformer's auxiliary
loss) over the router logits of every expert layer of one forward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.architecture import Architecture
from megatron.model.mlp import elementwise_activation


class Router(torch.nn.Module):
    def __init__(self, arch: Architecture):
        super().__init__()
        self.layer = torch.nn.Linear(arch.hidden_size, arch.moe_num_experts, bias=False)


class ExpertWeights(torch.nn.Module):
    """Every expert's MLP weights, stacked (GPT-NeoX's ParallelGroupedMLP / ParallelGroupedLLaMAMLP)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        self.num_experts, self.width, self.gated = arch.moe_num_experts, arch.moe_intermediate_size, arch.gated
        self.activation = elementwise_activation(arch)
        shape = (arch.moe_num_experts * arch.moe_intermediate_size, arch.hidden_size)
        self.w1 = torch.nn.Parameter(torch.empty(shape))
        if arch.gated:
            self.w3 = torch.nn.Parameter(torch.empty(shape))
        self.w2 = torch.nn.Parameter(torch.empty(shape))

    def rows(self, weight: torch.Tensor, expert: int) -> torch.Tensor:
        return weight.narrow(0, expert * self.width, self.width)

    def forward(self, expert: int, tokens: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s output for ``tokens`` [n, hidden]."""
        inner = self.activation(F.linear(tokens, self.rows(self.w1, expert)))
        if self.gated:
            inner = inner * F.linear(tokens, self.rows(self.w3, expert))
        return inner @ self.rows(self.w2, expert)


class Experts(torch.nn.Module):
    def __init__(self, arch: Architecture):
        super().__init__()
        self.mlp = ExpertWeights(arch)


class MixtureOfExperts(torch.nn.Module):
    def __init__(self, arch: Architecture):
        super().__init__()
        self.top_k, self.norm_topk_prob = arch.moe_top_k, arch.moe_norm_topk_prob
        self.router = Router(arch)
        self.experts = Experts(arch)

    def forward(self, hidden: torch.Tensor, router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The experts' weighted outputs for ``hidden`` [..., hidden]; the router's logits [tokens, experts]
        are appended to ``router_logits`` when given (for ``load_balancing_loss``)."""
        tokens = hidden.reshape(-1, hidden.shape[-1])
        logits = self.router.layer(tokens)
        if router_logits is not None:
            router_logits.append(logits)
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        weights_by_choice, chosen_by_choice = weights.t(), chosen.t()  # [top_k, tokens]: transformers' order
        for expert in range(self.experts.mlp.num_experts):
            choice, token = torch.where(chosen_by_choice == expert)
            if token.numel():
                expert_out = self.experts.mlp(expert, tokens[token]) * weights_by_choice[choice, token, None]
                out.index_add_(0, token, expert_out.to(out.dtype))
        return out.reshape(hidden.shape)


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Transformers' auxiliary loss: num_experts x sum over experts of (share of the top-k choices that went to
    the expert) x (its mean router probability), both taken over every token of every expert layer together."""
    choices = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probabilities = torch.zeros_like(choices)
    for logits in router_logits:
        layer_probabilities = torch.softmax(logits, dim=-1)  # in the logits' dtype, as transformers takes it
        _, chosen = torch.topk(layer_probabilities, top_k, dim=-1)
        choices = choices + torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        probabilities = probabilities + layer_probabilities.float().sum(dim=0)
    rows = sum(logits.shape[0] for logits in router_logits)
    return torch.sum((choices / rows) * (probabilities / rows)) * num_experts
