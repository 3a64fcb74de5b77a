"""A mixture-of-experts layer in place of the MLP: top-k routing as Hugging Face computes it, or GPT-NeoX's
sinkhorn routing; dropless.

Names and layout are GPT-NeoX's (``ParallelDroplessMoE``): the router ``router.layer`` (hidden ->
experts, no bias) and the experts' weights stacked along their first dimension, each expert's rows
together: ``experts.mlp.w1`` [experts x width, hidden] (for swiglu the gate), ``experts.mlp.w3`` (swiglu
only: the up projection) and ``experts.mlp.w2`` [experts x width, hidden], the down projection
transposed. What each token gets (megatron/contract/architecture.py) follows transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
step by step, so its numbers are theirs: the router's logits in the model's dtype, their softmax in
fp32, the ``top_k`` largest probabilities (renormalised with ``norm_topk_prob``) weighing the outputs
of the chosen experts, which are added up expert by expert in ascending order. No token is dropped.
In training, ``moe_jitter_eps`` multiplies the router's input (not the experts') by noise drawn uniformly
from [1 - eps, 1 + eps], as GPT-NeoX's topk router does.

GPT-NeoX's sinkhorn router (``moe_router_type: sinkhorn``, its ``SinkhornRouter``) weighs the chosen experts
by the sigmoid of their logits (top_k 1) or their softmax (top_k > 1), in the logits' dtype. In training it
chooses each token's experts by the top_k of ``sinkhorn(logits)``, which balances the experts' load over the
micro batch; in evaluation and generation by the top_k of those weights, as GPT-NeoX does.

The experts run as one grouped computation (megatron/model/grouped_experts.py): the routed (token, expert)
pairs sorted by expert, each projection one ``torch._grouped_mm`` over the stacked weights, on CPU and GPU
alike. Where that grouped matmul does not run (decided once per device, dtype and shape, and printed), the
experts run one after the other on the tokens routed to each, with the same results.

With ``moe_shared_expert_intermediate_size`` the layer has Qwen2-MoE's shared expert beside the routed ones
(``SharedExpert``): every token's output from the experts gets the shared expert's output added, times the
sigmoid of ``shared_expert_gate`` (hidden -> 1, replicated over tensor-parallel ranks) of the token.

Under tensor parallelism the experts are split over the ranks as GPT-NeoX's ``ParallelDroplessMLP`` splits
them (megatron/model/partitioning.py: rank r holds a run of whole experts, their rows of every expert
weight), and the tokens are on every rank. Each rank routes all tokens (the router is replicated, its
logits and load-balancing loss the same on every rank), runs its own experts and the ranks sum their
outputs (megatron-core's reduce region). The experts' input and the routing weights enter through the copy
region, whose backward sums their gradients over the ranks, so the router and the layer's input get every
expert's contribution; the load-balancing loss's path bypasses it, being whole on every rank already.
A shared expert is split as the dense MLP, which sums its own parts: it is added after the experts' sum.

``load_balancing_loss`` is transformers' ``load_balancing_loss_func`` (Switch Transformer's auxiliary
loss) over the router logits of every expert layer of one forward pass; ``expert_load`` is what share of a
layer's routed token slots each expert got, from the router's choices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.contract.architecture import Architecture
from megatron.model.grouped_experts import grouped_experts, grouped_matmul_runs
from megatron.model.mlp import MLP, elementwise_activation
from megatron.model.parallel_layers import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from megatron.model.partitioning import local_experts
from megatron.model.sequence_parallel import gather_sequence, scatter_sequence
from megatron.ranks import tensor_parallel_rank, tensor_parallel_size


@dataclass
class Routing:
    """What one expert layer's router did for one forward pass."""

    logits: torch.Tensor  # [tokens, experts], in the model's dtype
    chosen: torch.Tensor  # [tokens, top_k]: the experts each token went to


class Router(torch.nn.Module):
    def __init__(self, arch: Architecture):
        super().__init__()
        # drawn with the other weights (init_methods.initialise_parameters), not here: building a model draws
        # nothing, so a pipeline stage that builds another stage's layers keeps build_model's stream of draws
        self.layer = torch.nn.utils.skip_init(torch.nn.Linear, arch.hidden_size, arch.moe_num_experts, bias=False)


class ExpertWeights(torch.nn.Module):
    """This tensor-parallel rank's experts' MLP weights, stacked (GPT-NeoX's ParallelGroupedMLP /
    ParallelGroupedLLaMAMLP)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        self.local = local_experts(arch, tensor_parallel_rank(), tensor_parallel_size())
        self.width, self.gated = arch.moe_intermediate_size, arch.gated
        self.activation = elementwise_activation(arch)
        shape = (len(self.local) * arch.moe_intermediate_size, arch.hidden_size)
        self.w1 = torch.nn.Parameter(torch.empty(shape))
        if arch.gated:
            self.w3 = torch.nn.Parameter(torch.empty(shape))
        self.w2 = torch.nn.Parameter(torch.empty(shape))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(w1, w3 or None, w2) as the experts compute with them: with LoRA adapters on the experts (a child
        ``lora``, megatron/model/lora.py) each expert's slice plus its adapters' scaled B A, as PEFT's
        ``target_parameters`` adds them to the parameter."""
        w1, w3, w2 = self.w1, self.w3 if self.gated else None, self.w2
        adapters = getattr(self, "lora", None)
        if adapters is None or not adapters.switched_on:
            return w1, w3, w2
        return with_expert_deltas((w1, w3, w2), adapters.deltas(), self.width)

    def rows(self, weight: torch.Tensor, expert: int) -> torch.Tensor:
        return weight.narrow(0, (expert - self.local.start) * self.width, self.width)

    def forward(self, expert: int, tokens: torch.Tensor, weights: tuple | None = None) -> torch.Tensor:
        """Expert ``expert``'s output (one of ``self.local``) for ``tokens`` [n, hidden]; ``weights``: those of
        ``self.weights()``, when the caller has them for several experts."""
        w1, w3, w2 = weights or self.weights()
        inner = self.activation(F.linear(tokens, self.rows(w1, expert)))
        if self.gated:
            inner = inner * F.linear(tokens, self.rows(w3, expert))
        return inner @ self.rows(w2, expert)


def with_expert_deltas(weights: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
                       deltas: dict[str, torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Stacked expert weights (w1, w3, w2) plus ``deltas`` by transformers' parameter name, each [experts, out, in]
    as its 3-D parameter is: ``gate_up_proj``'s gate rows go to w1, its up rows to w3, ``down_proj``'s
    transposes to w2."""
    w1, w3, w2 = weights
    if "gate_up_proj" in deltas:
        gate, up = deltas["gate_up_proj"].split(width, dim=1)
        w1, w3 = w1 + gate.reshape(w1.shape), w3 + up.reshape(w3.shape)
    if "down_proj" in deltas:
        w2 = w2 + deltas["down_proj"].transpose(1, 2).reshape(w2.shape)
    return w1, w3, w2


class Experts(torch.nn.Module):
    def __init__(self, arch: Architecture):
        super().__init__()
        self.mlp = ExpertWeights(arch)


class SharedExpert(torch.nn.Module):
    """Qwen2-MoE's shared expert: the model's dense MLP, ``moe_shared_expert_intermediate_size`` wide and without
    biases. Under ``mlp`` so that its weights end as a dense layer's (mlp.linear1.weight, ...) and are drawn and
    split over tensor-parallel ranks as those are."""

    def __init__(self, arch: Architecture, init_method, output_init_method):
        super().__init__()
        shape = dataclasses.replace(arch, intermediate_size=arch.moe_shared_expert_intermediate_size, bias_in_mlp=False)
        self.mlp = MLP(shape, init_method, output_init_method)


def sinkhorn(logits: torch.Tensor, tolerance: float = 1e-4) -> torch.Tensor:
    """GPT-NeoX's Sinkhorn-Knopp balancing of exp(logits) [tokens, experts]: each token's row and each expert's
    column scaled in turn towards sums of 1/tokens and 1/experts, until the experts' scales move by at most
    ``tolerance`` on average."""
    cost = torch.exp(logits)
    tokens, experts = cost.shape
    token_scale = torch.ones(tokens, device=cost.device, dtype=cost.dtype)
    expert_scale = torch.ones(experts, device=cost.device, dtype=cost.dtype)
    guard = 1e-8  # GPT-NeoX's: no division by zero
    while True:
        token_scale = 1 / (tokens * ((cost * expert_scale).sum(dim=1) + guard))
        previous, expert_scale = expert_scale, 1 / (experts * ((cost * token_scale[:, None]).sum(dim=0) + guard))
        if torch.mean(torch.abs(expert_scale - previous)) <= tolerance:
            return cost * expert_scale * token_scale[:, None]


class MixtureOfExperts(torch.nn.Module):
    def __init__(self, arch: Architecture, init_method, output_init_method):
        super().__init__()
        self.top_k, self.norm_topk_prob = arch.moe_top_k, arch.moe_norm_topk_prob
        self.router_type, self.jitter_eps = arch.moe_router_type, arch.moe_jitter_eps
        self.router = Router(arch)
        self.experts = Experts(arch)
        self.shared_expert = self.shared_expert_gate = None
        if arch.moe_shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(arch, init_method, output_init_method)
            self.shared_expert_gate = torch.nn.Linear(arch.hidden_size, 1, bias=False)
            # no weight draw reaches it (megatron/model/partitioning.py lists the drawn ones): zeros, the same
            # for every tensor-parallel size, open each token's shared expert halfway (sigmoid(0))
            torch.nn.init.zeros_(self.shared_expert_gate.weight)

    def _route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the router's logits [tokens, experts], each token's experts' weights and indices [tokens, top_k])."""
        if self.router_type == "sinkhorn":
            logits = self.router.layer(tokens)
            scores = (torch.sigmoid(logits) if self.top_k == 1
                      else torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits))
            if not self.training:
                return logits, *torch.topk(scores, self.top_k, dim=-1)
            with torch.no_grad():
                chosen = torch.topk(sinkhorn(logits.float()), self.top_k, dim=-1).indices
            return logits, scores.gather(1, chosen), chosen
        if self.training and self.jitter_eps:
            tokens = tokens * torch.empty_like(tokens).uniform_(1 - self.jitter_eps, 1 + self.jitter_eps)
        logits = self.router.layer(tokens)
        return logits, *torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)

    def forward(self, hidden: torch.Tensor, routing: list[Routing] | None = None, split: bool = False) -> torch.Tensor:
        """The experts' weighted outputs for ``hidden`` [..., hidden]; what the router did is appended to
        ``routing`` when given (for ``load_balancing_loss`` and ``expert_load``).

        With ``split`` (sequence parallelism) ``hidden`` and the output are this rank's part of the sequence [b, s/tp,
        hidden]: the experts run on the whole sequence as without it, gathered before and split after. The whole
        sequence's gradient is the same on every rank here (the copy regions sum it), so the gather's backward keeps
        this rank's slice of it."""
        if split:
            return scatter_sequence(self(gather_sequence(hidden, gradient_is_replicated=True), routing))
        tokens = hidden.reshape(-1, hidden.shape[-1])
        logits, weights, chosen = self._route(tokens)
        if routing is not None:
            routing.append(Routing(logits, chosen.detach()))
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # [top_k, tokens]: transformers' order. The copy region's input is made contiguous so that the gradient
        # reaching it is too: megatron-core's all-reduce of a non-contiguous gradient sums a copy and drops it
        weights_by_choice = copy_to_tensor_parallel_region(weights.t().contiguous())
        chosen_by_choice, expert_input = chosen.t(), copy_to_tensor_parallel_region(tokens)
        if grouped_matmul_runs(tokens.device, tokens.dtype, tokens.shape[-1], self.experts.mlp.width):
            out = grouped_experts(self.experts.mlp, expert_input, weights_by_choice, chosen_by_choice, tokens.dtype)
        else:
            out = self._experts_one_by_one(expert_input, weights_by_choice, chosen_by_choice)
        out = reduce_from_tensor_parallel_region(out)
        if self.shared_expert is not None:  # split over the ranks as the dense MLP, which sums its own parts
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert.mlp(tokens)
        return out.reshape(hidden.shape)

    def _experts_one_by_one(self, expert_input: torch.Tensor, weights_by_choice: torch.Tensor,
                            chosen_by_choice: torch.Tensor) -> torch.Tensor:
        """``grouped_experts``'s result where the grouped matmul does not run: each local expert in turn on its
        tokens."""
        out, weights = torch.zeros_like(expert_input), self.experts.mlp.weights()
        # an expert without tokens still computes (on none): the copy regions' backward, a collective, then
        # runs on every rank, also where no local expert got a token
        for expert in self.experts.mlp.local:
            choice, token = torch.where(chosen_by_choice == expert)
            expert_out = self.experts.mlp(expert, expert_input[token], weights) * weights_by_choice[choice, token, None]
            out.index_add_(0, token, expert_out.to(out.dtype))
        return out


def load_balancing_sums(logits: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """One expert layer's part of ``load_balancing_loss``, [2, experts] in fp32: how many of its tokens' top-k
    choices of the router's softmax went to each expert, and each expert's router probability summed over them."""
    probabilities = torch.softmax(logits, dim=-1)  # in the logits' dtype, as transformers takes it
    _, chosen = torch.topk(probabilities, top_k, dim=-1)
    return torch.stack([torch.bincount(chosen.reshape(-1), minlength=num_experts).float(),
                        probabilities.float().sum(dim=0)])


def load_balancing_loss_of_sums(sums: torch.Tensor, rows: int, num_experts: int) -> torch.Tensor:
    """``load_balancing_loss`` from the ``load_balancing_sums`` of every expert layer added up, over ``rows``
    (tokens x expert layers)."""
    choices, probabilities = sums
    return torch.sum((choices / rows) * (probabilities / rows)) * num_experts


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Transformers' auxiliary loss: num_experts x sum over experts of (share of the top-k choices that went to
    the expert) x (its mean router probability), both taken over every token of every expert layer together."""
    sums = torch.zeros(2, num_experts, dtype=torch.float32, device=router_logits[0].device)
    for logits in router_logits:
        sums = sums + load_balancing_sums(logits, num_experts, top_k)
    return load_balancing_loss_of_sums(sums, sum(logits.shape[0] for logits in router_logits), num_experts)


def expert_load(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each expert's share of the routed token slots (tokens x top_k) in ``chosen`` [tokens, top_k]; sums to 1."""
    return torch.bincount(chosen.reshape(-1), minlength=num_experts).float() / chosen.numel()
