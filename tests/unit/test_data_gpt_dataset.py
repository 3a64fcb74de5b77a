"""GPT samples, cached indices, splits, blending, resumable DP-sharded iterators (real files, real loaders)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.data import (
    DataError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    build_data_iterators,
    build_train_valid_test_datasets,
    get_batch,
    index_cache,
)
from megatron.data.builders import split_document_ranges
from megatron.data.gpt_dataset import GPTDataset
from megatron.neox_arguments import NeoXArgs

SEQ = 16


def make_args(**data_settings) -> NeoXArgs:
    settings = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ, train_iters=10,
        train_micro_batch_size_per_gpu=2, optimizer={"type": "Adam", "params": {"lr": 1e-3}},
        tokenizer_type="ByteLevelTokenizer", seed=1234,
    )
    settings.update(data_settings)
    return NeoXArgs.from_dict(settings)


def write_documents(prefix, documents: list[np.ndarray], dtype=np.uint16) -> str:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for document in documents:
        builder.add_item(document)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def random_documents(seed: int, count: int, low: int = 0, high: int = 1000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(low, high, size=rng.integers(0, 60)) for _ in range(count)]


def test_samples_are_consecutive_tokens_across_documents(tmp_path):
    documents = random_documents(0, 50)
    data = MMapIndexedDataset(write_documents(tmp_path / "d", documents))
    dataset = GPTDataset("train", data, np.arange(10, 40), num_samples=200, seq_length=SEQ, seed=3)
    assert len(dataset) >= 200
    split_tokens = sum(len(documents[i]) for i in range(10, 40))
    epochs = len(dataset.doc_idx) // 30
    for epoch in range(epochs):  # every epoch visits each document of the split once
        assert sorted(dataset.doc_idx[epoch * 30:(epoch + 1) * 30]) == list(range(10, 40))
    assert len(dataset) == (epochs * split_tokens - 1) // SEQ
    stream = np.concatenate([documents[d] for d in dataset.doc_idx])
    served = set()
    for i in range(len(dataset)):
        text = dataset[i]["text"]
        assert text.dtype == np.int64 and text.shape == (SEQ + 1,)
        sample = int(dataset.shuffle_idx[i])
        np.testing.assert_array_equal(text, stream[sample * SEQ: sample * SEQ + SEQ + 1])
        served.add(sample)
    assert served == set(range(len(dataset)))
    assert not np.array_equal(dataset.shuffle_idx, np.arange(len(dataset)))


def _index_files(directory) -> dict[str, int]:
    return {name: os.stat(directory / name).st_mtime_ns for name in os.listdir(directory) if "_indexmap_" in name}


def test_indices_are_cached_and_rebuilt_when_settings_or_data_change(tmp_path):
    prefix = write_documents(tmp_path / "d", random_documents(1, 40))

    def build(num_samples=100, seq_length=SEQ, seed=1, prefix=prefix):
        return GPTDataset("train", MMapIndexedDataset(prefix), np.arange(40), num_samples, seq_length, seed)

    first = build()
    files = _index_files(tmp_path)
    assert first.built_index and len(files) == 4  # doc, sample, shuffle indices and their metadata
    again = build()
    assert not again.built_index and _index_files(tmp_path) == files
    np.testing.assert_array_equal(again.shuffle_idx, first.shuffle_idx)

    for changed in (dict(num_samples=150), dict(seq_length=SEQ + 1), dict(seed=2)):
        assert build(**changed).built_index, changed
    assert len(_index_files(tmp_path)) == 4 * 4
    assert not build(seed=2).built_index

    before = _index_files(tmp_path)
    write_documents(tmp_path / "d", random_documents(99, 40))  # same prefix, new data
    rebuilt = build()
    assert rebuilt.built_index
    after = _index_files(tmp_path)
    assert set(after) == set(before)  # the same files, rewritten
    changed_files = {name for name in after if after[name] != before[name]}
    assert changed_files == {name for name in files}


def test_unwritable_data_directory_falls_back_to_cache_dir(tmp_path, monkeypatch):
    data_dir = tmp_path / "readonly"
    data_dir.mkdir()
    prefix = write_documents(data_dir / "d", random_documents(2, 20))
    real_access = os.access
    # Tests run as root, for whom chmod does not stop writes: make the check see a read-only directory.
    monkeypatch.setattr(index_cache.os, "access",
                        lambda path, mode: False if os.path.samefile(path, data_dir) else real_access(path, mode))
    cache = tmp_path / "cache"
    dataset = GPTDataset("train", MMapIndexedDataset(prefix), np.arange(20), 30, SEQ, 1, index_cache_dir=cache)
    assert dataset.built_index
    assert not _index_files(data_dir) and len(_index_files(cache)) == 4
    again = GPTDataset("train", MMapIndexedDataset(prefix), np.arange(20), 30, SEQ, 1, index_cache_dir=cache)
    assert not again.built_index


def test_split_proportions_of_documents(tmp_path):
    documents = [np.full(20, i, dtype=np.int64) for i in range(1000)]  # document i holds only token i
    args = make_args(data_path=write_documents(tmp_path / "d", documents), split="969, 30, 1")
    train, valid, test = build_train_valid_test_datasets(args, (500, 100, 10))
    for dataset, (start, end) in zip((train, valid, test), [(0, 969), (969, 999), (999, 1000)], strict=True):
        tokens = np.unique(np.concatenate([dataset[i]["text"] for i in range(len(dataset))]))
        assert tokens.min() >= start and tokens.max() < end
    assert split_document_ranges("969, 30, 1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges("1", 7) == [(0, 7), (7, 7), (7, 7)]
    assert split_document_ranges("80,20", 10) == [(0, 8), (8, 10), (10, 10)]
    _, valid, test = build_train_valid_test_datasets(make_args(data_path=args.data_path, split="1"), (5, 5, 5))
    assert valid is None and test is None


def test_blending_proportions_exact_and_deterministic(tmp_path):
    # Dataset k only holds tokens in [1000 k, 1000 k + 999], so a sample names its source.
    paths = [write_documents(tmp_path / f"d{k}", random_documents(k, 30, 1000 * k, 1000 * k + 1000))
             for k in range(3)]
    args = make_args(train_data_paths=paths, train_data_weights=[5, 3, 2],
                     valid_data_paths=paths[:1], test_data_paths=None)
    num_samples = 1001
    train, valid, test = build_train_valid_test_datasets(args, (num_samples, 20, 0))
    assert test is None and len(valid) >= 20
    assert len(train) == num_samples
    sources = np.array([train[i]["text"][0] // 1000 for i in range(num_samples)])
    weights = np.array([0.5, 0.3, 0.2])
    counts = np.bincount(sources, minlength=3)
    assert counts.sum() == num_samples
    assert np.all(np.abs(counts - weights * num_samples) <= 1)
    for prefix_length in (10, 100, 500):  # the blend is spread out, not three blocks
        prefix_counts = np.bincount(sources[:prefix_length], minlength=3)
        assert np.all(np.abs(prefix_counts - weights * prefix_length) <= 2), (prefix_length, prefix_counts)
    again, _, _ = build_train_valid_test_datasets(args, (num_samples, 20, 0))
    for i in range(0, num_samples, 97):
        np.testing.assert_array_equal(again[i]["text"], train[i]["text"])


def test_weights_must_match_paths(tmp_path):
    path = write_documents(tmp_path / "d", random_documents(0, 10))
    # validation would refuse it (settings hold no such pair); the data layer must refuse it too
    args = SimpleNamespace(**{**make_args(train_data_paths=[path]).to_dict(), "train_data_weights": [0.5, 0.5]})
    with pytest.raises(DataError, match="train_data_weights has 2 weights for 1 data paths"):
        build_train_valid_test_datasets(args, (10, 0, 0))


def test_missing_dataset_names_setting(tmp_path):
    args = make_args(data_path=str(tmp_path / "absent"))
    with pytest.raises(DataError, match="data_path points at dataset prefix .*absent"):
        build_train_valid_test_datasets(args, (10, 1, 1))


def test_dataset_smaller_than_one_sample(tmp_path):
    args = make_args(data_path=write_documents(tmp_path / "d", [np.arange(5), np.arange(3)]), split="1")
    with pytest.raises(DataError, match="fewer than one sample"):
        build_train_valid_test_datasets(args, (10, 0, 0))


def _collect(iterator, steps: int) -> list[torch.Tensor]:
    return [next(iterator)["text"] for _ in range(steps)]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resumed_iterators_give_the_tail_of_each_ranks_shard(tmp_path, num_workers):
    args = make_args(data_path=write_documents(tmp_path / "d", random_documents(5, 60)), split="90, 10, 0",
                     train_micro_batch_size_per_gpu=3, num_workers=num_workers)
    micro, dp_size, steps, resume_step = 3, 2, 8, 3
    samples = (micro * dp_size * steps, 12, 0)
    full = {rank: _collect(build_data_iterators(args, samples, rank, dp_size)[0], steps) for rank in range(dp_size)}
    train, _, _ = build_train_valid_test_datasets(args, samples)
    for step in range(steps):  # each global batch is consecutive samples, rank r takes slice r
        for rank in range(dp_size):
            assert full[rank][step].shape == (micro, SEQ + 1) and full[rank][step].dtype == torch.long
            first = step * micro * dp_size + rank * micro
            expected = np.stack([train[first + i]["text"] for i in range(micro)])
            np.testing.assert_array_equal(full[rank][step].numpy(), expected)
    consumed = resume_step * micro * dp_size
    for rank in range(dp_size):
        resumed = build_data_iterators(args, samples, rank, dp_size, consumed_train_samples=consumed)[0]
        tail = list(resumed)[: steps - resume_step]
        assert len(tail) == steps - resume_step
        for got, want in zip(tail, full[rank][resume_step:], strict=True):
            assert torch.equal(got["text"], want)


def test_valid_iterator_cycles_and_train_ends(tmp_path):
    args = make_args(data_path=write_documents(tmp_path / "d", random_documents(6, 40)), split="50, 50")
    train_iter, valid_iter, test_iter = build_data_iterators(args, (4, 4, 0), 0, 1)
    assert test_iter is None
    train_len = len(build_train_valid_test_datasets(args, (4, 4, 0))[0])
    assert sum(1 for _ in train_iter) == train_len // 2
    _, valid, _ = build_train_valid_test_datasets(args, (4, 4, 0))
    batches = _collect(valid_iter, len(valid) + 3)  # far more batches than the split holds
    flat = torch.cat(batches)
    for i in range(len(flat)):
        np.testing.assert_array_equal(flat[i].numpy(), valid[i % len(valid)]["text"])


def test_get_batch_shifts_by_one():
    text = torch.arange(2 * (SEQ + 1)).reshape(2, SEQ + 1)
    batch = get_batch({"text": text})
    assert torch.equal(batch.tokens, text[:, :-1]) and torch.equal(batch.labels, text[:, 1:])
    assert torch.equal(batch.loss_mask, torch.ones(2, SEQ))
    assert batch.position_ids is None and batch.attention_mask is None
