"""Packed preference records (pack_impl pack_until_overflow, reset_attention_mask and reset_position_ids): a
DeepSpeed engine's first step over rows of several pairs (dpo, rm: dataset_impl pairwise) or rated answers (kto)
takes the loss and the gradients of the same records unpacked, one a row, in one micro batch."""

from __future__ import annotations

import deepspeed
import numpy as np
import pytest
import torch

from megatron.data import BatchOptions, MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.pairwise_dataset import PairwiseDataset
from megatron.model import build_model
from megatron.objectives.dpo import DirectPreferenceOptimization
from megatron.objectives.kto import KahnemanTverskyOptimization
from megatron.objectives.reward_model import RewardModelLoss
from tests.unit.test_model import LLAMA, VOCAB, randomize_, tiny_args
from tests.unit.test_sft_packing import EOD, M, write

pytestmark = pytest.mark.usefixtures("single_rank_world")

SEQ = 40
PAIRS = 10
KEYS = ("pos", "neg", "pos_label", "neg_label")
ENGINE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
          "zero_optimization": {"stage": 0}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def pair_files(folder) -> dict:
    """Chats of a shared prompt (labels masked) and a chosen or rejected answer of other lengths, each with an eod
    inside the answer too (a chat may hold one) and the eod at its end, both trained."""
    rng = np.random.RandomState(11)
    sides = {key: [] for key in KEYS}
    for _ in range(PAIRS):
        prompt = rng.randint(2, VOCAB, rng.randint(2, 5))
        for side in ("pos", "neg"):
            answer = np.concatenate([rng.randint(2, VOCAB, rng.randint(1, 4)), [EOD], rng.randint(2, VOCAB, 2), [EOD]])
            sides[side].append(np.concatenate([prompt, answer]))
            sides[f"{side}_label"].append(np.concatenate([np.full(len(prompt), M), answer]))
    return {key: write(folder / key, documents) for key, documents in sides.items()}


def packed_and_unpacked(tmp_path) -> tuple[dict, dict]:
    files = pair_files(tmp_path)
    packed = PairwiseDataset("train", files["pos"], files["neg"], np.arange(PAIRS), 2, SEQ, 5, tmp_path,
                             "pack_until_overflow", pos_label=files["pos_label"], neg_label=files["neg_label"])
    unpacked = PairwiseDataset("train", files["pos"], files["neg"], np.arange(PAIRS), PAIRS, SEQ, 5, tmp_path,
                               "unpacked", pos_label=files["pos_label"], neg_label=files["neg_label"])
    return same_records(packed, unpacked, KEYS)


def rated_answers(folder) -> tuple[GPTDataset, GPTDataset]:
    """KTO's records (a masked prompt, an answer holding an eod of its own, the eod; rewards 1, -1 or 0.5) read
    packed (2 rows) and unpacked (one pass)."""
    rng = np.random.RandomState(12)
    texts, labels = [], []
    for _ in range(PAIRS):
        prompt = rng.randint(2, VOCAB, rng.randint(2, 5))
        answer = np.concatenate([rng.randint(2, VOCAB, rng.randint(1, 4)), [EOD], rng.randint(2, VOCAB, 2), [EOD]])
        texts.append(np.concatenate([prompt, answer]))
        labels.append(np.concatenate([np.full(len(prompt), M), answer]))
    builder = MMapIndexedDatasetBuilder(str(folder / "reward.bin"), np.float32)
    for value in rng.choice([1.0, -1.0, 0.5], PAIRS):
        builder.add_item(np.array([value], dtype=np.float32))
        builder.end_document()
    builder.finalize(str(folder / "reward.idx"))
    files = dict(label_dataset=write(folder / "label", labels), reward_dataset=MMapIndexedDataset(folder / "reward"))
    text = write(folder / "text", texts)
    return (GPTDataset("train", text, np.arange(PAIRS), 2, SEQ, 5, folder, "pack_until_overflow", **files),
            GPTDataset("train", text, np.arange(PAIRS), PAIRS, SEQ, 5, folder, "unpacked", **files))


def same_records(packed, unpacked, keys) -> tuple[dict, dict]:
    """Two packed rows and, one a row in the same order, the records they hold."""
    row_of = {int(unpacked.doc_idx[int(unpacked.shuffle_idx[i])]): i for i in range(len(unpacked))}
    documents = []
    for row in range(2):
        sample = int(packed.shuffle_idx[row])
        documents += [int(d) for d in packed.doc_idx[packed.sample_idx[sample][0]:packed.sample_idx[sample + 1][0]]]
    assert len(documents) > 4, "the rows should hold several records each"
    rows = [packed[row] for row in range(2)]
    alone = [unpacked[row_of[d]] for d in documents]
    return ({key: torch.stack([torch.from_numpy(r[key]) for r in rows]) for key in rows[0]},
            {key: torch.stack([torch.from_numpy(r[key]) for r in alone]) for key in keys})


def tiny_model(seed: int = 7, **settings) -> torch.nn.Module:
    model = build_model(tiny_args(LLAMA, seq_length=SEQ, padded_vocab_size=VOCAB, **settings).architecture(), 1234)
    randomize_(model, seed)
    return model


def first_step(make_model, objective, samples) -> tuple[float, dict[str, torch.Tensor]]:
    engine, *_ = deepspeed.initialize(model=make_model(), config=ENGINE)
    loss, _ = objective(engine, samples)
    engine.backward(loss)
    return loss.item(), {name: p.grad.clone() for name, p in engine.module.named_parameters()}


def assert_same_first_step(make_model, objective_with, packed, unpacked) -> None:
    """objective_with(batch options): the objective; the unpacked pairs run as the unpacked run does, without the
    reset settings (which, given no segments, would also cut at the eods inside the chats)."""
    objective = objective_with(RESET)
    packed_loss, packed_grads = first_step(make_model, objective, packed)
    unpacked_loss, unpacked_grads = first_step(make_model, objective_with(BatchOptions()), unpacked)
    assert packed_loss == pytest.approx(unpacked_loss, rel=1e-5)
    for name, grad in unpacked_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    leaking = {key: value for key, value in packed.items() if not key.endswith("segment")}
    assert abs(first_step(make_model, objective, leaking)[0] - unpacked_loss) > 1e-4  # rows scored whole


RESET = BatchOptions(eod=EOD, reset_position_ids=True, reset_attention_mask=True)


def test_packed_dpo_first_step_equals_the_same_pairs_unpacked(tmp_path):
    packed, unpacked = packed_and_unpacked(tmp_path)
    reference = tiny_model(seed=8).eval()  # another model, so the loss is not ln 2 on both sides by construction
    assert_same_first_step(tiny_model, lambda options: DirectPreferenceOptimization(
        options, beta=0.1, fp32=True, reference=reference), packed, unpacked)


def test_packed_reward_model_first_step_equals_the_same_pairs_unpacked(tmp_path):
    packed, unpacked = packed_and_unpacked(tmp_path)
    def reward_model():
        return tiny_model(train_impl="rm", no_weight_tying=True, dataset_impl="pairwise", pack_impl="unpacked")

    assert_same_first_step(reward_model, lambda options: RewardModelLoss(options, z_loss=0.01), packed, unpacked)


def test_packed_kto_first_step_equals_the_same_answers_unpacked(tmp_path):
    packed, unpacked = same_records(*rated_answers(tmp_path), ("text", "label", "reward"))
    reference = tiny_model(seed=8).eval()
    assert_same_first_step(tiny_model, lambda options: KahnemanTverskyOptimization(
        options, beta=0.1, fp32=True, desirable_weight=1.0, undesirable_weight=1.3, reference=reference),
        packed, unpacked)
