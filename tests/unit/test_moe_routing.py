"""GPT-NeoX's routers (megatron/model/moe.py) against computations written here from their definitions:
sinkhorn (Sinkhorn-Knopp balancing in training, the top k of the sigmoid or softmax in evaluation) and the
topk router's input jitter (moe_jitter_eps)."""

from __future__ import annotations

import pytest
import torch

from megatron.hf.config import unrepresentable
from megatron.model import expert_load
from megatron.model.moe import MixtureOfExperts, Routing, sinkhorn
from megatron.neox_arguments import NeoXArgs
from tests.ckpt_engines import ARCHITECTURE

EXPERTS, HIDDEN = 8, 8


def experts_layer(**settings) -> MixtureOfExperts:
    values = dict(ARCHITECTURE, hidden_size=HIDDEN, moe_num_experts=EXPERTS, moe_intermediate_size=16)
    layer = MixtureOfExperts(NeoXArgs.from_dict({**values, **settings}).architecture(), None, None)  # no draws
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return layer


def balanced_by_matrix_scaling(logits: torch.Tensor, tolerance: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp (Cuturi 2013) as GPT-NeoX runs it: K = exp(logits) scaled to diag(u) K diag(v) with row sums
    towards 1/tokens (u = r / K v) and column sums 1/experts (v = c / K^T u), in turn, starting from v = 1, until v
    moves by at most `tolerance` on average; 1e-8 keeps each division finite. In float64, by matrix products."""
    kernel = torch.exp(logits.double())
    tokens, experts = kernel.shape
    u, v = torch.ones(tokens, dtype=torch.float64), torch.ones(experts, dtype=torch.float64)
    while True:
        u = (1 / tokens) / (kernel @ v + 1e-8)
        v_next = (1 / experts) / (kernel.T @ u + 1e-8)
        moved, v = (v_next - v).abs().mean(), v_next
        if moved <= tolerance:
            return torch.diag(u) @ kernel @ torch.diag(v)


def routed(layer: MixtureOfExperts, hidden: torch.Tensor) -> tuple[torch.Tensor, Routing]:
    routing: list[Routing] = []
    out = layer(hidden, routing)
    return out, routing[0]


def weighted_experts(layer: MixtureOfExperts, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
    """Each token's chosen experts' outputs, weighed, token by token."""
    return torch.stack([sum(weights[t, k] * layer.experts.mlp(int(chosen[t, k]), tokens[t:t + 1])[0]
                            for k in range(chosen.shape[1])) for t in range(tokens.shape[0])])


def test_sinkhorn_is_the_published_matrix_scaling():
    logits = torch.randn(64, EXPERTS, generator=torch.Generator().manual_seed(1)) * 3
    balanced = sinkhorn(logits)
    expected = balanced_by_matrix_scaling(logits)
    torch.testing.assert_close(balanced.double(), expected, rtol=1e-5, atol=0)
    assert torch.equal(balanced.topk(2).indices, expected.topk(2).indices)
    torch.testing.assert_close(balanced.sum(dim=0).double(), torch.full((EXPERTS,), 1 / EXPERTS, dtype=torch.float64))


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_sinkhorn_router_chooses_by_sinkhorn_in_training_and_by_its_scores_in_evaluation(top_k):
    layer = experts_layer(moe_router_type="sinkhorn", moe_top_k=top_k)
    hidden = torch.randn(2, 24, HIDDEN, generator=torch.Generator().manual_seed(2))
    tokens = hidden.reshape(-1, HIDDEN)
    logits = tokens @ layer.router.layer.weight.T
    scores = torch.sigmoid(logits) if top_k == 1 else torch.softmax(logits, dim=-1)  # GPT-NeoX's activations
    with torch.no_grad():
        out, routing = routed(layer.train(), hidden)
        chosen = balanced_by_matrix_scaling(logits).topk(top_k).indices
        assert torch.equal(routing.chosen, chosen)
        torch.testing.assert_close(out.reshape(-1, HIDDEN),
                                   weighted_experts(layer, tokens, chosen, scores.gather(1, chosen)))
        out, routing = routed(layer.eval(), hidden)
        weights, chosen = scores.topk(top_k)
        assert torch.equal(routing.chosen, chosen)
        torch.testing.assert_close(out.reshape(-1, HIDDEN), weighted_experts(layer, tokens, chosen, weights))


def test_sinkhorn_spreads_the_tokens_of_a_router_that_favours_one_expert():
    layer = experts_layer(moe_router_type="sinkhorn", moe_top_k=1)
    hidden = torch.rand(1, 64, HIDDEN, generator=torch.Generator().manual_seed(3))  # positive
    with torch.no_grad():
        layer.router.layer.weight.normal_(std=0.1).abs_()[3] += 1  # expert 3 scores highest for every token
        _, evaluated = routed(layer.eval(), hidden)
        _, trained = routed(layer.train(), hidden)
    assert expert_load(evaluated.chosen, EXPERTS)[3] == 1.0
    assert expert_load(trained.chosen, EXPERTS).max() < 0.5  # from every token; an even share is 0.125


def test_jitter_multiplies_the_router_input_by_noise_within_eps_in_training_only():
    layer = experts_layer(moe_router_type="topk", moe_top_k=2, moe_jitter_eps=0.1)
    with torch.no_grad():
        layer.router.layer.weight.copy_(torch.eye(EXPERTS))  # the logits are the router's input itself
    hidden = torch.randn(1, 32, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, trained = routed(layer.train(), hidden)
        _, evaluated = routed(layer.eval(), hidden)
    ratio = trained.logits / hidden.reshape(-1, HIDDEN)
    assert 0.9 - 1e-6 <= ratio.min() < 0.92 and 1.08 < ratio.max() <= 1.1 + 1e-6
    assert torch.equal(evaluated.logits, hidden.reshape(-1, HIDDEN))
    unjittered = experts_layer(moe_router_type="topk", moe_top_k=2)
    with torch.no_grad():
        unjittered.router.layer.weight.copy_(torch.eye(EXPERTS))
        assert torch.equal(routed(unjittered.train(), hidden)[1].logits, hidden.reshape(-1, HIDDEN))


def test_a_sinkhorn_model_is_not_exported_as_a_family_that_routes_by_top_k():
    values = dict(ARCHITECTURE, hidden_size=HIDDEN, moe_num_experts=EXPERTS, moe_top_k=2, norm="rmsnorm",
                  activation="swiglu", intermediate_size=24, rotary_pct=1.0, use_bias_in_mlp=False,
                  use_bias_in_norms=False)
    for family in ("mixtral", "qwen3_moe"):
        topk = unrepresentable(NeoXArgs.from_dict({**values, "moe_router_type": "topk"}).architecture(), family)
        sinkhorn = unrepresentable(NeoXArgs.from_dict({**values, "moe_router_type": "sinkhorn"}).architecture(), family)
        assert [problem for problem in sinkhorn if problem not in topk] == [f"moe_router_type='sinkhorn' ({family} needs 'topk')"]
