"""DPO and KTO (megatron/objectives/dpo.py, kto.py) against losses and gradients computed independently on the
Hugging Face model holding the same weights (fp32, both families), and their exact values at the first step,
where the policy is the reference."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.data import BatchOptions
from megatron.objectives.dpo import DirectPreferenceOptimization
from megatron.objectives.kto import KahnemanTverskyOptimization
from tests.unit.test_model import VOCAB
from tests.unit.test_model_hf_equivalence import (
    gpt_neox_pair,
    llama_pair,
    llama_state_from_hf,
    neox_state_from_hf,
)

pytestmark = pytest.mark.usefixtures("single_rank_world")

FAMILIES = {"gpt-neox": (gpt_neox_pair, neox_state_from_hf),
            "llama": (llama_pair, lambda hf: llama_state_from_hf(hf, kv_heads=2, tied=False))}


def policy_and_reference(family: str):
    """(ours, hf) for the policy and for the reference: the reference is the pair as built, the policy the
    same models moved by other random amounts (the same in both)."""
    pair, state_from_hf = FAMILIES[family]
    reference, reference_hf = pair()
    policy_hf = copy.deepcopy(reference_hf)
    gen = torch.Generator().manual_seed(22)
    with torch.no_grad():
        for p in policy_hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    policy = pair()[0]
    policy.load_state_dict(state_from_hf(policy_hf), strict=True)
    return policy.eval(), policy_hf.eval(), reference.eval(), reference_hf.eval(), state_from_hf


def answers(seed: int, rows: int = 2, length: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and aligned labels: a masked prompt, an odd negative label, padding at the end of one row."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(1, VOCAB, (rows, length), generator=gen)
    label = text.clone()
    label[:, :3] = -100
    label[0, 6] = -7
    label[1, 8:] = -100
    text[1, 8:] = 0
    return text, label


def pairs() -> dict[str, torch.Tensor]:
    pos, pos_label = answers(3)
    neg, neg_label = answers(4)
    return {"pos": pos, "neg": neg, "pos_label": pos_label, "neg_label": neg_label}


def hf_sequence_log_probs(hf, text: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Sum over the trained targets of log p(target), from transformers' full-vocabulary logits."""
    log_probs = torch.log_softmax(hf(input_ids=text).logits[:, :-1].float(), dim=-1)
    targets = label[:, 1:]
    trained = targets >= 0
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * trained).sum(dim=1)


def hf_gradients_in_our_names(hf, state_from_hf) -> dict[str, torch.Tensor]:
    grads = {name: p.grad for name, p in hf.named_parameters()}
    return state_from_hf(SimpleNamespace(state_dict=lambda: grads))


def assert_same_gradients(ours, expected: dict[str, torch.Tensor]) -> None:
    actual = {name: p.grad for name, p in ours.named_parameters()}
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("reference_free", [False, True], ids=["reference", "reference-free"])
def test_dpo_loss_and_gradients_equal_an_independent_computation_on_hugging_face(family, reference_free):
    policy, policy_hf, reference, reference_hf, state_from_hf = policy_and_reference(family)
    samples, beta = pairs(), 0.5
    objective = DirectPreferenceOptimization(BatchOptions(), beta, fp32=True, reference=reference,
                                             reference_free=reference_free)
    loss, metrics = objective(policy, samples)
    loss.backward()

    chosen = hf_sequence_log_probs(policy_hf, samples["pos"], samples["pos_label"])
    rejected = hf_sequence_log_probs(policy_hf, samples["neg"], samples["neg_label"])
    with torch.no_grad():
        ref_chosen = hf_sequence_log_probs(reference_hf, samples["pos"], samples["pos_label"])
        ref_rejected = hf_sequence_log_probs(reference_hf, samples["neg"], samples["neg_label"])
    if reference_free:
        ref_chosen, ref_rejected = torch.zeros(2), torch.zeros(2)
    expected = -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()
    torch.testing.assert_close(metrics["chosen_rewards"], chosen_rewards.mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(metrics["rejected_rewards"], rejected_rewards.mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(metrics["margins"], (chosen_rewards - rejected_rewards).mean(), atol=1e-5, rtol=1e-5)
    assert metrics["reward_acc"].item() == (chosen_rewards > rejected_rewards).float().mean().item()
    assert_same_gradients(policy, hf_gradients_in_our_names(policy_hf, state_from_hf))
    assert all(p.grad is None for p in reference.parameters())  # the reference is never differentiated


def test_dpo_at_the_first_step_is_ln2_with_zero_rewards():
    reference, policy = llama_pair()[0].eval(), llama_pair()[0].eval()  # the same weights
    loss, metrics = DirectPreferenceOptimization(BatchOptions(), 0.1, fp32=True, reference=reference)(policy, pairs())
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    for name in ("chosen_rewards", "rejected_rewards", "margins"):
        assert metrics[name].item() == pytest.approx(0.0, abs=1e-6)
    assert metrics["reward_acc"].item() == 0.0  # GPT-NeoX's strict >: ties are not accurate


def test_dpo_reads_precomputed_reference_log_probs_as_the_live_reference_gives_them():
    policy, _, reference, reference_hf, _ = policy_and_reference("gpt-neox")
    samples = pairs()
    with torch.no_grad():  # per target: entry j is log p(token j+1), as GPT-NeoX's precompute files hold them
        for side in ("pos", "neg"):
            logits = reference_hf(input_ids=samples[side]).logits[:, :-1]
            targets = samples[side][:, 1:]
            samples[f"{side}_ref"] = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    live = DirectPreferenceOptimization(BatchOptions(), 0.3, True, reference=reference)(policy, pairs())[0]
    read = DirectPreferenceOptimization(BatchOptions(), 0.3, True, reference=None)(policy, samples)[0]
    torch.testing.assert_close(read, live, atol=1e-5, rtol=1e-5)


def kto_samples(rewards=(1.0, -1.0, -1.0, 1.0), length: int = 11) -> dict[str, torch.Tensor]:
    text, label = answers(5, rows=4, length=length)
    return {"text": text, "label": label, "reward": torch.tensor(rewards)}


def hf_kto_loss(policy_hf, reference_hf, samples, beta, desirable, undesirable) -> torch.Tensor:
    """KTO by its formula: the KL point of each half is the mean of max(l, 0) over the other half."""
    with torch.no_grad():
        reference = hf_sequence_log_probs(reference_hf, samples["text"], samples["label"])
    ratio = hf_sequence_log_probs(policy_hf, samples["text"], samples["label"]) - reference
    clamped = ratio.detach().clamp(min=0)
    point = torch.tensor([clamped[2:].mean()] * 2 + [clamped[:2].mean()] * 2)
    reward = samples["reward"]
    weight = torch.where(reward > 0, desirable, undesirable)
    return (weight * (1 - torch.sigmoid(beta * torch.sign(reward) * (ratio - point)))).mean()


@pytest.mark.parametrize("family", FAMILIES)
def test_kto_loss_and_gradients_equal_an_independent_computation_on_hugging_face(family):
    policy, policy_hf, reference, reference_hf, state_from_hf = policy_and_reference(family)
    samples = kto_samples()
    objective = KahnemanTverskyOptimization(BatchOptions(), 0.5, True, 1.0, 1.5, reference=reference)
    loss, _ = objective(policy, samples)
    loss.backward()
    expected = hf_kto_loss(policy_hf, reference_hf, samples, 0.5, 1.0, 1.5)
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert_same_gradients(policy, hf_gradients_in_our_names(policy_hf, state_from_hf))


def test_kto_at_the_first_step_is_one_half_with_zero_kl():
    reference, policy = gpt_neox_pair()[0].eval(), gpt_neox_pair()[0].eval()  # the same weights
    loss, metrics = KahnemanTverskyOptimization(BatchOptions(), 0.1, True, 1.0, 1.0, reference=reference)(
        policy, kto_samples())
    assert loss.item() == pytest.approx(0.5, abs=1e-6)
    assert metrics["kl"].item() == pytest.approx(0.0, abs=1e-6)


def test_kto_does_not_depend_on_padding_length():
    """GPT-NeoX scales beta by the reward averaged over the padded sequence, so padding changes its gradients;
    here a sample's reward is its own, and padding the same documents changes nothing."""
    policy, _, reference, _, _ = policy_and_reference("llama")
    objective = KahnemanTverskyOptimization(BatchOptions(), 0.5, True, 1.0, 1.0, reference=reference)
    short = kto_samples()
    padded = {"text": F.pad(short["text"], (0, 6)), "label": F.pad(short["label"], (0, 6), value=-100),
              "reward": short["reward"][:, None].expand(-1, 17) * (F.pad(short["label"], (0, 6), value=-100) >= 0)}
    results = []
    for samples in (short, padded):
        policy.zero_grad()
        loss, _ = objective(policy, samples)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-6, rtol=1e-5)
