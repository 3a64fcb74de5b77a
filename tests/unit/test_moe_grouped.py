"""The grouped expert path (megatron/model/grouped_experts.py) against the per-expert loop it replaces
(MixtureOfExperts._experts_one_by_one) on random routing: the same outputs and gradients in fp32, with experts
that get no tokens, top_k 1, 2 and 3 (where the order a token's outputs are added in shows), and with the experts split as over 2 tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from megatron.model.grouped_experts import grouped_experts, grouped_matmul_runs
from megatron.model.moe import MixtureOfExperts
from megatron.neox_arguments import NeoXArgs
from tests.ckpt_engines import ARCHITECTURE

EXPERTS, HIDDEN, WIDTH, TOKENS = 8, 32, 48, 40
IDLE = (1, 4, 6)  # experts that get no tokens


def experts_layer(activation: str) -> MixtureOfExperts:
    values = dict(ARCHITECTURE, hidden_size=HIDDEN, moe_num_experts=EXPERTS, moe_intermediate_size=WIDTH,
                  intermediate_size=96, activation=activation)
    layer = MixtureOfExperts(NeoXArgs.from_dict(values).architecture(), None, None)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return layer


def keep_experts(layer: MixtureOfExperts, local: range) -> None:
    """Make ``layer`` hold only ``local``'s experts, as a tensor-parallel rank holds its run of them."""
    mlp = layer.experts.mlp
    for name in ("w1", "w2", "w3") if mlp.gated else ("w1", "w2"):
        rows = getattr(mlp, name).detach()[local.start * mlp.width:local.stop * mlp.width].clone()
        setattr(mlp, name, torch.nn.Parameter(rows))
    mlp.local = local


def random_routing(top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` distinct experts (none of IDLE), in random order, and positive fp32 weights."""
    generator = torch.Generator().manual_seed(seed)
    busy = torch.tensor([e for e in range(EXPERTS) if e not in IDLE])
    chosen = torch.stack([busy[torch.randperm(len(busy), generator=generator)[:top_k]] for _ in range(TOKENS)])
    return chosen, torch.rand(TOKENS, top_k, generator=generator) + 0.1


def outputs_and_gradients(layer: MixtureOfExperts, run) -> list[torch.Tensor]:
    layer.zero_grad()
    tokens = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    chosen, weights = random_routing(run.top_k, run.seed)
    weights.requires_grad_(True)
    out = run(layer, tokens, weights, chosen)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    return [out.detach(), tokens.grad, weights.grad] + [p.grad.clone() for p in layer.experts.mlp.parameters()]


class Run:
    def __init__(self, top_k: int, seed: int, grouped: bool):
        self.top_k, self.seed, self.grouped = top_k, seed, grouped

    def __call__(self, layer, tokens, weights, chosen):
        if not self.grouped:
            return layer._experts_one_by_one(tokens, weights.t(), chosen.t())
        return grouped_experts(layer.experts.mlp, tokens, weights.t(), chosen.t(), tokens.dtype)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("local", [range(0, 8), range(0, 4), range(4, 8)], ids=["whole", "rank0of2", "rank1of2"])
def test_the_grouped_experts_give_the_loops_outputs_and_gradients(activation, top_k, local):
    assert grouped_matmul_runs(torch.device("cpu"), torch.float32, HIDDEN, WIDTH)
    layer = experts_layer(activation)
    keep_experts(layer, local)
    loop = outputs_and_gradients(layer, Run(top_k, seed=3, grouped=False))
    grouped = outputs_and_gradients(layer, Run(top_k, seed=3, grouped=True))
    assert loop[0].abs().sum() > 0
    for theirs, ours in zip(loop, grouped, strict=True):  # sums over tokens may add in another order: 1e-6 of their scale
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6 * float(theirs.abs().max()))


def test_a_rank_whose_experts_get_no_tokens_adds_zeros_and_gradients_of_zero():
    layer = experts_layer("swiglu")
    keep_experts(layer, range(4, 6))  # only expert 5 is busy: route every token to 0, 2 and 3 instead
    tokens = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    chosen = torch.tensor([[0, 2]] * TOKENS)
    out = grouped_experts(layer.experts.mlp, tokens, torch.ones(2, TOKENS), chosen.t(), tokens.dtype)
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(tokens.grad, torch.zeros_like(tokens))
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in layer.experts.mlp.parameters())


def test_the_first_layer_to_ask_inside_activation_recomputation_is_recorded_once():
    # the probe's own backward must not unpack the recomputation's saved tensors (that re-runs the layer, whose
    # router then records its choices twice: the objective's expert loads no longer match the expert layers)
    layer = experts_layer("swiglu")
    grouped_matmul_runs.cache_clear()
    hidden = torch.randn(2, TOKENS // 2, HIDDEN, requires_grad=True)
    routing = []
    out = torch.utils.checkpoint.checkpoint(layer, hidden, routing, use_reentrant=False)
    assert len(routing) == 1
    out.sum().backward()
    assert hidden.grad is not None


def test_a_first_question_asked_without_gradients_gets_the_answer_training_gets():
    grouped_matmul_runs.cache_clear()
    with torch.no_grad():  # evaluation or generation may run the first expert layer
        without_gradients = grouped_matmul_runs(torch.device("cpu"), torch.float32, HIDDEN, WIDTH)
    grouped_matmul_runs.cache_clear()
    assert without_gradients == grouped_matmul_runs(torch.device("cpu"), torch.float32, HIDDEN, WIDTH)
