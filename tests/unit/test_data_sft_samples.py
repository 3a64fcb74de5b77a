"""Samples of every pack_impl with labels riding along, against fixtures worked out by hand from
GPT-NeoX's megatron/data/gpt2_dataset.py (its RandomState draws, in its order), and the batch they make."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron.data import (
    DataError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    build_train_valid_test_datasets,
)
from megatron.data.batches import BatchOptions, get_batch
from megatron.data.gpt_dataset import GPTDataset
from tests.unit.test_data_gpt_dataset import make_args

M = -100
SEQ = 4  # samples of 5 tokens
TEXT = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31], [40], [50, 51, 52, 53]]
LABEL = [[M, 11, 12], [M, M, 22, 23, 24, 25, 26], [M, M], [40], [M, 51, 52, 53]]  # doc 2: all masked; doc 1: too long


def write(prefix, documents) -> MMapIndexedDataset:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for document in documents:
        builder.add_item(document)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return MMapIndexedDataset(prefix)


@pytest.fixture
def files(tmp_path):
    return write(tmp_path / "sft_text_document", TEXT), write(tmp_path / "sft_text_label_document", LABEL)


def items(dataset) -> list[tuple[list[int], list[int]]]:
    return [(dataset[i]["text"].tolist(), dataset[i]["label"].tolist()) for i in range(len(dataset))]


# RandomState(1): the sample order [2 1 4 0 3 5]; pack_until_overflow's document order per pass
# [0 2 4 3 1], then [4 3 2 1 0], then [1 4 3 2 0] (each shuffled in place from the one before).
ORDER = [2, 1, 4, 0, 3, 5]
D0_D4 = ([10, 11, 12, 50, 0], [M, 11, 12, M, M])
D4_D3 = ([50, 51, 52, 53, 40], [M, 51, 52, 53, 40])  # d4, d3, then the borrowed token cut off
D1 = ([20, 21, 22, 23, 24], [M, M, 22, 23, 24])  # chopped to seq_length + 1
D0_ALONE = ([10, 11, 12, 0, 0], [M, 11, 12, M, M])  # the last sample: no next document to borrow from
EXPECTED = {
    ("unpacked", True): [([10, 11, 12, 20, 0], [M, 11, 12, M, M]), D1, ([40, 50, 0, 0, 0], [40, M, M, M, M]),
                         ([50, 51, 52, 53, 10], [M, 51, 52, 53, M])] * 2,
    ("unpacked", False): [([10, 11, 12, 40, 0], [M, 11, 12, 40, M]), ([40, 50, 0, 0, 0], [40, M, M, M, M]),
                          ([50, 51, 52, 53, 10], [M, 51, 52, 53, M])] * 2,
    ("pack_until_overflow", True): [D0_D4, D4_D3, D1, D4_D3, D1, D0_ALONE],
    ("pack_until_overflow", False): [D0_D4, D4_D3, D4_D3, D0_D4, D4_D3, D0_ALONE],
}


@pytest.mark.parametrize("pack_impl, allow_chopped", sorted(EXPECTED))
def test_whole_document_samples_are_gpt_neox_s(files, pack_impl, allow_chopped):
    text, labels = files
    dataset = GPTDataset("train", text, np.arange(5), 6, SEQ, seed=1, pack_impl=pack_impl,
                         allow_chopped=allow_chopped, label_dataset=labels)
    samples = EXPECTED[(pack_impl, allow_chopped)]
    assert items(dataset) == [samples[sample] for sample in ORDER]


def test_packed_samples_carry_the_same_slice_of_the_labels(files):
    text, labels = files
    dataset = GPTDataset("train", text, np.arange(5), 10, SEQ, seed=3, label_dataset=labels)
    token_stream = np.concatenate([TEXT[d] for d in dataset.doc_idx])
    label_stream = np.concatenate([LABEL[d] for d in dataset.doc_idx])
    for i in range(len(dataset)):
        start = int(dataset.shuffle_idx[i]) * SEQ
        assert dataset[i]["text"].tolist() == token_stream[start:start + SEQ + 1].tolist()
        assert dataset[i]["label"].tolist() == label_stream[start:start + SEQ + 1].tolist()


def test_unpacked_without_labels_masks_only_the_padding(files):
    dataset = GPTDataset("train", files[0], np.arange(5), 6, SEQ, seed=1, pack_impl="unpacked")
    # every document is usable now: the order of samples is documents 0..4, then 0
    assert dataset[ORDER.index(3)]["text"].tolist() == [40, 50, 0, 0, 0]
    assert dataset[ORDER.index(3)]["label"].tolist() == [40, 50, M, M, M]


def test_labels_that_do_not_match_the_tokens_are_refused(files, tmp_path):
    short = write(tmp_path / "short_label_document", LABEL[:4])
    with pytest.raises(DataError, match="does not match"):
        GPTDataset("train", files[0], np.arange(5), 6, SEQ, seed=1, pack_impl="unpacked", label_dataset=short)
    masked = write(tmp_path / "masked_label_document", [[M] * len(t) for t in TEXT])
    with pytest.raises(DataError, match="no document to sample"):
        GPTDataset("train", files[0], np.arange(5), 6, SEQ, seed=1, pack_impl="unpacked", label_dataset=masked)


def test_blended_label_datasets_through_the_settings(tmp_path):
    first = write(tmp_path / "a_text_document", TEXT), write(tmp_path / "a_label_document", LABEL)
    second_text = [[60 + i, 61 + i] for i in range(6)]
    second = write(tmp_path / "b_text_document", second_text), write(tmp_path / "b_label_document", second_text)
    args = make_args(train_data_paths=[first[0].prefix, second[0].prefix], train_data_weights=[3, 1],
                     train_label_data_paths=[first[1].prefix, second[1].prefix], pack_impl="unpacked",
                     seq_length=SEQ)
    train, _, _ = build_train_valid_test_datasets(args, (40, 0, 0))
    assert len(train) == 40
    # each dataset is indexed for GPT-NeoX's number of samples: ceil(40 x weight x 1.005)
    assert [len(d) for d in train.datasets] == [math.ceil(40 * 0.75 * 1.005), math.ceil(40 * 0.25 * 1.005)]
    served = [train[i] for i in range(len(train))]
    from_second = [s for s in served if s["text"][0] >= 60]
    assert len(from_second) == 10
    assert all(s["label"].tolist() == s["text"][:3].tolist() + [M, M] for s in from_second)
    with pytest.raises(DataError, match="1 prefixes for 2 train_data_paths"):
        build_train_valid_test_datasets(args.with_values({"train_label_data_paths": [first[1].prefix]}, "test"),
                                        (40, 0, 0))


def test_the_batch_trains_exactly_the_non_negative_labels_and_eod_mask_loss():
    text = torch.tensor([[5, 6, 7, 0, 8, 9], [5, 0, 6, 7, 8, 9]])
    label = torch.tensor([[M, M, 7, 0, M, -3], [M, 0, 6, M, 8, 9]])
    batch = get_batch({"text": text, "label": label})
    assert batch.tokens.tolist() == [[5, 6, 7, 0, 8], [5, 0, 6, 7, 8]]
    assert batch.labels.tolist() == [[0, 7, 0, 0, 0], [0, 6, 0, 8, 9]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0], [1, 1, 0, 1, 1]]
    masked = get_batch({"text": text, "label": label}, BatchOptions(eod=0, eod_mask_loss=True))
    assert masked.loss_mask.tolist() == [[0, 1, 1, 0, 0], [1, 0, 0, 1, 1]]  # the input is eod: not trained


def test_reset_positions_and_attention_at_each_eod():
    text = torch.tensor([[5, 6, 0, 7, 0, 8, 9], [0, 5, 6, 7, 8, 9, 9]])
    batch = get_batch({"text": text}, BatchOptions(eod=0, reset_position_ids=True, reset_attention_mask=True))
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    document = [[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]]
    for row in range(2):
        for query in range(6):
            for key in range(6):
                sees = key <= query and document[row][key] == document[row][query]
                assert bool(batch.attention_mask[row, 0, query, key]) == sees
