"""The REINFORCE objective's loss and metrics against GPT-NeoX's formulas written out here, for every kl_impl, on a
small real torch model (an embedding and a linear output: logits from the inputs), at one rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.data import BatchOptions
from megatron.objectives.reinforce import Reinforce
from megatron.rollouts.scored_samples import ScoredCompletion, samples_of

VOCAB = 11


class TinyLM(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = torch.nn.Embedding(VOCAB, 8)
        self.output = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens, position_ids=None, attention_mask=None, parallel_output=False):
        return self.output(torch.tanh(self.embedding(tokens)))


ROWS = [ScoredCompletion([1, 2], [3, 4, 5], 1.0, 0.7), ScoredCompletion([6], [7], 0.0, -0.7),
        ScoredCompletion([2, 2, 2], [9, 10], 0.5, 0.2)]


def neox_loss(policy, reference, samples, kl_impl: str, beta: float):
    text, label = samples["text"], samples["label"]
    tokens, targets = text[:, :-1], label[:, 1:]
    mask = (targets >= 0).float()
    labels = targets.clamp(min=0)
    logp_full = F.log_softmax(policy(tokens).float(), -1)
    ref_full = F.log_softmax(reference(tokens).float(), -1).detach()
    lp = logp_full.gather(-1, labels[..., None])[..., 0]
    rp = ref_full.gather(-1, labels[..., None])[..., 0]
    k = {"abs": (lp - rp).abs(), "mse": 0.5 * (lp - rp) ** 2, "kl": lp - rp,
         "full": F.kl_div(ref_full, logp_full, log_target=True, reduction="none").sum(-1)}[kl_impl]
    per_token = -lp * samples["reward"] + beta * k
    loss = ((per_token * mask).sum(1) / mask.sum()).mean()
    return loss, {"ref_logp": rp.mean(), "logp": lp.mean(), "reward": samples["raw_reward"].mean(),
                  "reward_std": samples["raw_reward"].std(), "kl": k.mean()}


@pytest.mark.parametrize("kl_impl", ["abs", "mse", "kl", "full"])
def test_loss_gradient_and_metrics_are_gpt_neox_formulas(kl_impl):
    samples = samples_of(ROWS, seq_length=7)
    policy, reference = TinyLM(0), TinyLM(1)
    loss, metrics = Reinforce(BatchOptions(), kl_impl, 0.3, True, reference)(policy, samples)
    expected, expected_metrics = neox_loss(policy, reference, samples, kl_impl, 0.3)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert list(metrics) == ["ref_logp", "logp", "reward", "reward_std", "kl"]
    assert {n: v.item() for n, v in metrics.items()} == pytest.approx({n: v.item() for n, v in
                                                                       expected_metrics.items()}, rel=1e-5)
    ours = torch.autograd.grad(loss, list(policy.parameters()))
    theirs = torch.autograd.grad(expected, list(policy.parameters()))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, theirs, strict=True))


def test_kl_div_beta_zero_has_no_reference_and_no_kl_metrics():
    objective = Reinforce(BatchOptions(), "mse", 0.0, True, TinyLM(1))
    loss, metrics = objective(TinyLM(0), samples_of(ROWS, seq_length=7))
    assert objective.reference is None and list(metrics) == ["logp", "reward", "reward_std"]
    assert objective.metric_names == ("logp", "reward", "reward_std")
