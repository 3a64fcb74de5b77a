"""Packed SFT without cross-document attention (reset_attention_mask, reset_position_ids): a row of packed label-file
documents trains as its documents would each alone, for both packing pack_impls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.data import BatchOptions, MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.gpt_dataset import GPTDataset
from megatron.model import build_model
from megatron.model.attention import attention_path
from megatron.objectives.language_model import LanguageModelLoss
from tests.unit.test_model import LLAMA, VOCAB, randomize_, tiny_args

pytestmark = pytest.mark.usefixtures("single_rank_world")

EOD, M = 1, -100
SEQ = 40


def records(count: int = 12) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """SFT records of 4 to 12 tokens: a prompt (labels masked), a response and the eod, both trained."""
    rng = np.random.RandomState(3)
    texts, labels = [], []
    for _ in range(count):
        prompt, response = rng.randint(2, VOCAB, rng.randint(2, 6)), rng.randint(2, VOCAB, rng.randint(1, 6))
        texts.append(np.concatenate([prompt, response, [EOD]]))
        labels.append(np.concatenate([np.full(len(prompt), M), response, [EOD]]))
    return texts, labels


def write(prefix, documents) -> MMapIndexedDataset:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for document in documents:
        builder.add_item(document)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return MMapIndexedDataset(prefix)


def documents_of(text: torch.Tensor) -> list[tuple[int, int]]:
    """(first, last) input position of each document in a row of seq_length + 1 tokens: each ends at its eod."""
    ends = [int(i) for i in torch.nonzero(text[:-1] == EOD).flatten()]
    starts = [0] + [end + 1 for end in ends]
    return [(start, end) for start, end in zip(starts, ends + [len(text) - 2], strict=True) if start <= end]


@pytest.mark.parametrize("pack_impl", ["packed", "pack_until_overflow"])
def test_packed_sft_first_step_equals_each_document_alone(tmp_path, pack_impl):
    texts, labels = records()
    data = write(tmp_path / "sft_text_document", texts)
    label_data = write(tmp_path / "sft_label_document", labels)
    dataset = GPTDataset("train", data, np.arange(len(texts)), 4, SEQ, 5, pack_impl=pack_impl, label_dataset=label_data)
    samples = {key: torch.stack([torch.from_numpy(dataset[i][key]) for i in range(2)]) for key in ("text", "label")}
    model = build_model(tiny_args(LLAMA, seq_length=SEQ, padded_vocab_size=VOCAB).architecture(), 1234)
    randomize_(model)

    reset = BatchOptions(eod=EOD, reset_position_ids=True, reset_attention_mask=True)
    packed_loss, _ = LanguageModelLoss(reset)(model, samples)
    packed_loss.backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    alone_sum, trained, pieces = 0.0, 0, 0
    for row in range(2):
        text, label = samples["text"][row], samples["label"][row]
        for first, last in documents_of(text):
            piece = {"text": text[first:last + 2][None], "label": label[first:last + 2][None]}
            count = int((piece["label"][:, 1:] >= 0).sum())
            if count:
                loss, _ = LanguageModelLoss(BatchOptions())(model, piece)
                (loss * count).backward()  # summed over the document's trained tokens
                alone_sum, trained, pieces = alone_sum + loss.item() * count, trained + count, pieces + 1
    assert pieces > 2, "the rows should hold several documents each"
    assert packed_loss.item() == pytest.approx(alone_sum / trained, rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad / trained, rtol=1e-4, atol=1e-6, msg=name)

    leaking, _ = LanguageModelLoss(BatchOptions())(model, samples)  # without the reset settings
    assert abs(leaking.item() - packed_loss.item()) > 1e-4


def test_the_start_up_line_names_the_attention_path():
    arch = tiny_args(LLAMA, seq_length=SEQ, padded_vocab_size=VOCAB).architecture()
    assert attention_path(arch, block_causal=False).endswith("causal (is_causal)")
    assert "block-causal per packed document (reset_attention_mask)" in attention_path(arch, block_causal=True)
