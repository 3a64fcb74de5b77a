"""From settings to datasets and data-loader iterators: what the training loop calls."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from megatron.data.blendable_dataset import BlendableDataset, normalize_weights, samples_per_dataset
from megatron.data.data_settings import DataSettings
from megatron.data.data_vocabulary import check_vocabulary
from megatron.data.errors import DataError
from megatron.data.gpt_dataset import GPTDataset, check_gpt_files
from megatron.data.indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path
from megatron.data.pairwise_dataset import PairwiseDataset, check_pairwise_files
from megatron.data.samplers import DistributedBatchSampler

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> np.ndarray:
    """"969, 30, 1" -> normalised train/valid/test proportions (missing ones are 0)."""
    try:
        parts = [float(p) for p in split.replace("/", ",").split(",") if p.strip()]
    except ValueError as err:
        raise DataError(f"split {split!r} must be comma-separated numbers such as '969, 30, 1'") from err
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise DataError(f"split {split!r} must give 1 to 3 non-negative proportions with a positive sum")
    parts += [0.0] * (3 - len(parts))
    return np.asarray(parts) / sum(parts)


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) document ranges of train, valid and test."""
    bounds = np.concatenate([[0], np.round(np.cumsum(parse_split(split)) * num_documents)]).astype(np.int64)
    bounds[-1] = num_documents
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


def _gpt_dataset(settings: DataSettings, name: str, data: MMapIndexedDataset, documents: np.ndarray, num_samples: int,
                 label_data: MMapIndexedDataset | None = None, reward_data: MMapIndexedDataset | None = None,
                 reference_data: MMapIndexedDataset | None = None) -> GPTDataset:
    return GPTDataset(name, data, documents, num_samples, settings.seq_length, settings.seed, pack_impl=settings.pack_impl,
                      allow_chopped=settings.allow_chopped, label_dataset=label_data, reward_dataset=reward_data,
                      reference_dataset=reference_data)


def _companion_paths(settings: DataSettings, setting: str, paths: Sequence[str], of: str) -> list[str | None]:
    """The prefixes of `setting` (label or reward files), one per entry of `of`, or None each when unset."""
    companions = getattr(settings, setting)
    if not companions:
        return [None] * len(paths)
    if len(companions) != len(paths):
        raise DataError(f"{setting} has {len(companions)} prefixes for {len(paths)} {of}; "
                        "give one per data path, in the same order")
    return list(companions)


def _open(prefix: str | None, setting: str) -> MMapIndexedDataset | None:
    return MMapIndexedDataset(prefix, setting=setting) if prefix else None


def reference_log_probs_prefix(data_prefix: str, name: str) -> str:
    """Where GPT-NeoX's precompute_model_name files of a data prefix are (float32 .bin/.idx)."""
    return f"{data_prefix}_{name}"


def _reference_log_probs(settings: DataSettings, data_prefix: str, setting: str) -> MMapIndexedDataset | None:
    """The precomputed reference log-probabilities of `data_prefix` (precompute_model_name), if it is set."""
    if not settings.precompute_model_name:
        return None
    prefix = reference_log_probs_prefix(data_prefix, settings.precompute_model_name)
    missing = [path for path in (data_file_path(prefix), index_file_path(prefix)) if not Path(path).is_file()]
    if missing:
        raise DataError(f"{setting}: precompute_model_name is {settings.precompute_model_name!r} but {missing[0]} does "
                        "not exist; write it with generate.py (text_gen_type: precompute, load: the reference "
                        "model), or unset precompute_model_name to run the reference model live")
    return MMapIndexedDataset(prefix, setting=f"precompute_model_name ({setting})")


def _index_samples(settings: DataSettings, count: int, num_samples: int, weight: float) -> int:
    # Whole-document samples are indexed for as many samples as GPT-NeoX asks of each dataset (0.5 % more
    # than its share), because that number seeds their order: the same files give the same samples.
    return int(count) if settings.pack_impl == "packed" else math.ceil(num_samples * weight * 1.005)


def _split_files(settings: DataSettings, name: str) -> list[dict[str, MMapIndexedDataset | None]]:
    """Every file of split `name` opened, one dict per data path, keyed as the split's dataset takes them
    (gpt2: data, labels, rewards, reference; pairwise: pos, neg, pos_label, neg_label, pos_ref, neg_ref)."""
    if settings.dataset_impl == "pairwise":
        pos_paths, of = getattr(settings, f"pos_{name}_data_paths"), f"pos_{name}_data_paths"
        if not getattr(settings, f"neg_{name}_data_paths"):
            raise DataError(f"{of} needs neg_{name}_data_paths beside it (chosen prefix k pairs with rejected prefix k)")
        columns = [pos_paths, *(_companion_paths(settings, setting, pos_paths, of) for setting in
                                (f"neg_{name}_data_paths", f"pos_{name}_label_data_paths", f"neg_{name}_label_data_paths"))]
        return [{"pos": _open(pos, f"pos_{name}_data_paths[{i}]"), "neg": _open(neg, f"neg_{name}_data_paths[{i}]"),
                 "pos_label": _open(pos_label, f"pos_{name}_label_data_paths[{i}]"),
                 "neg_label": _open(neg_label, f"neg_{name}_label_data_paths[{i}]"),
                 "pos_ref": _reference_log_probs(settings, pos, f"pos_{name}_data_paths[{i}]"),
                 "neg_ref": _reference_log_probs(settings, neg, f"neg_{name}_data_paths[{i}]")}
                for i, (pos, neg, pos_label, neg_label) in enumerate(zip(*columns, strict=True))]
    paths = getattr(settings, f"{name}_data_paths")
    columns = [paths, *(_companion_paths(settings, f"{name}_{kind}_data_paths", paths, f"{name}_data_paths")
                        for kind in ("label", "reward"))]
    return [{"data": MMapIndexedDataset(path, setting=f"{name}_data_paths[{i}]"),
             "labels": _open(label, f"{name}_label_data_paths[{i}]"),
             "rewards": _open(reward, f"{name}_reward_data_paths[{i}]"),
             "reference": _reference_log_probs(settings, path, f"{name}_data_paths[{i}]")}
            for i, (path, label, reward) in enumerate(zip(*columns, strict=True))]


def _split_datasets(settings: DataSettings, name: str, num_samples: int, normalised: np.ndarray) -> list:
    """One dataset per data path of split `name` (gpt2: {name}_data_paths; pairwise: pos_/neg_{name}_data_paths)."""
    counts = samples_per_dataset(normalised, num_samples)
    datasets = []
    for i, files in enumerate(_split_files(settings, name)):
        samples = _index_samples(settings, counts[i], num_samples, normalised[i])
        if settings.dataset_impl == "pairwise":
            datasets.append(PairwiseDataset(name, files["pos"], files["neg"], np.arange(len(files["pos"])), samples,
                                            settings.seq_length, settings.seed, pack_impl=settings.pack_impl,
                                            allow_chopped=settings.allow_chopped, pos_label=files["pos_label"],
                                            neg_label=files["neg_label"], pos_ref=files["pos_ref"],
                                            neg_ref=files["neg_ref"]))
        else:
            datasets.append(_gpt_dataset(settings, name, files["data"], np.arange(len(files["data"])), samples,
                                         files["labels"], files["rewards"], files["reference"]))
    return datasets


def _blended_dataset(settings: DataSettings, name: str, paths: Sequence[str], weights, num_samples: int):
    if weights is None:
        weights = [1.0] * len(paths)
    normalised = normalize_weights(weights, paths, f"{name}_data_weights")
    datasets = _split_datasets(settings, name, num_samples, normalised)
    if len(datasets) == 1:
        return datasets[0]
    return BlendableDataset(datasets, normalised, num_samples)


def build_train_valid_test_datasets(args, train_valid_test_num_samples: tuple[int, int, int]):
    """`datasets_for` the data settings of the run's settings `args`."""
    return datasets_for(DataSettings.from_args(args), train_valid_test_num_samples)


def datasets_for(settings: DataSettings, train_valid_test_num_samples: tuple[int, int, int]):
    """(train, valid, test) datasets of {"text": int64[seq_length + 1]} items (pairwise: {"pos", "neg", ...});
    a split without data or without requested samples is None."""
    if settings.seq_length is None or settings.seq_length < 1:
        raise DataError("seq_length must be set to a positive number of tokens to build GPT samples")
    for name in SPLIT_NAMES:
        if getattr(settings, f"{name}_label_data_paths") and not getattr(settings, f"{name}_data_paths"):
            raise DataError(f"{name}_label_data_paths needs {name}_data_paths (label files pair with data paths "
                            f"one to one, as in GPT-NeoX); set {name}_data_paths")
    prefix = "pos_" if settings.dataset_impl == "pairwise" else ""
    if getattr(settings, f"{prefix}train_data_paths"):
        paths = {name: getattr(settings, f"{prefix}{name}_data_paths") for name in SPLIT_NAMES}
        weights = {"train": settings.train_data_weights, "valid": settings.valid_data_weights,
                   "test": settings.test_data_weights}
        return tuple(
            _blended_dataset(settings, name, paths[name], weights[name], int(num_samples))
            if paths[name] and num_samples > 0 else None
            for name, num_samples in zip(SPLIT_NAMES, train_valid_test_num_samples, strict=True)
        )
    if settings.data_path:
        data = MMapIndexedDataset(settings.data_path, setting="data_path")
        return tuple(
            None if documents is None else _gpt_dataset(settings, name, data, documents, int(num_samples))
            for name, documents, num_samples in zip(SPLIT_NAMES, _data_path_splits(settings, data, train_valid_test_num_samples),
                                                    train_valid_test_num_samples, strict=True)
        )
    raise DataError("no training data: set data_path (one dataset split by `split`), train_data_paths "
                    "(with valid_data_paths/test_data_paths), or embedded_corpus: true")


def _data_path_splits(settings: DataSettings, data: MMapIndexedDataset, train_valid_test_num_samples) -> list[np.ndarray | None]:
    """The documents of data_path each split reads (by `split`), None for a split without documents or samples."""
    ranges = split_document_ranges(settings.split, len(data))
    (train_start, train_end), train_samples = ranges[0], train_valid_test_num_samples[0]
    if train_samples > 0 and train_end == train_start:
        raise DataError(
            f"data_path: split {settings.split!r} gives the train split none of the {len(data)} documents of "
            f"{settings.data_path}; give it a larger share in `split`, or more documents"
        )
    return [np.arange(start, end) if end > start and num_samples > 0 else None
            for (start, end), num_samples in zip(ranges, train_valid_test_num_samples, strict=True)]


def check_data_files(settings: DataSettings, tokenizer_vocab_size: int, train_valid_test_num_samples: tuple[int, int, int]) -> None:
    """For deepy.py --dry-run: every check start-up makes of the files the run names (build_checked_datasets),
    without building a sample index; DataError. The vocabulary of the data (check_vocabulary), then each data
    path opened with its label, reward and precomputed files and checked as its dataset's constructor checks them
    (check_gpt_files, check_pairwise_files), so what the dry run passes, the start passes.
    """
    check_vocabulary(settings, tokenizer_vocab_size)
    if settings.data_path:
        data = MMapIndexedDataset(settings.data_path, setting="data_path")
        for name, documents in zip(SPLIT_NAMES, _data_path_splits(settings, data, train_valid_test_num_samples),
                                   strict=True):
            if documents is not None:
                check_gpt_files(name, data, documents, settings.seq_length, settings.pack_impl, allow_chopped=settings.allow_chopped)
        return
    prefix = "pos_" if settings.dataset_impl == "pairwise" else ""
    for name, num_samples in zip(SPLIT_NAMES, train_valid_test_num_samples, strict=True):
        if not getattr(settings, f"{prefix}{name}_data_paths") or num_samples <= 0:
            continue
        for files in _split_files(settings, name):
            if settings.dataset_impl == "pairwise":
                check_pairwise_files(name, seq_length=settings.seq_length, pack_impl=settings.pack_impl,
                                     allow_chopped=settings.allow_chopped, **files)
            else:
                check_gpt_files(name, documents=np.arange(len(files["data"])), seq_length=settings.seq_length,
                                pack_impl=settings.pack_impl, allow_chopped=settings.allow_chopped, **files)


def build_checked_datasets(settings: DataSettings, tokenizer_vocab_size: int, train_valid_test_num_samples: tuple[int, int, int]):
    """Start-up's datasets (datasets_for), after the vocabulary of their files is checked: the
    checks check_data_files makes for the dry run, each made once (the constructors check their files)."""
    check_vocabulary(settings, tokenizer_vocab_size)
    return datasets_for(settings, train_valid_test_num_samples)


def _loader(dataset, sampler: DistributedBatchSampler, num_workers: int):
    # Its own generator: starting an iterator draws a seed, which from the global generator would
    # shift every dropout mask after a resume (the RNG states are restored before the loaders start).
    return iter(DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, generator=torch.Generator()))


def build_data_iterators(
    args,
    train_valid_test_num_samples: tuple[int, int, int],
    data_parallel_rank: int,
    data_parallel_size: int,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
):
    """(train, valid, test) iterators of {"text": LongTensor[micro_batch, seq_length + 1]} batches, or None.

    The train iterator starts at global sample consumed_train_samples and ends with the dataset; the
    valid iterator starts at consumed_valid_samples, the test iterator at 0, and both cycle forever."""
    settings = DataSettings.from_args(args)
    return data_iterators(settings, datasets_for(settings, train_valid_test_num_samples), data_parallel_rank,
                          data_parallel_size, consumed_train_samples, consumed_valid_samples)


def data_iterators(settings: DataSettings, datasets, data_parallel_rank: int, data_parallel_size: int, consumed_train_samples: int = 0,
                   consumed_valid_samples: int = 0):
    """build_data_iterators over (train, valid, test) datasets built already."""
    micro = settings.train_micro_batch_size_per_gpu
    if not micro:
        raise DataError("train_micro_batch_size_per_gpu must be set to build data iterators")
    start = {"train": consumed_train_samples, "valid": consumed_valid_samples, "test": 0}
    iterators = []
    for name, dataset in zip(SPLIT_NAMES, datasets, strict=True):
        if dataset is None:
            iterators.append(None)
            continue
        sampler = DistributedBatchSampler(
            len(dataset),
            start[name],
            micro,
            data_parallel_rank,
            data_parallel_size,
            cycle=name != "train",
        )
        iterators.append(_loader(dataset, sampler, settings.num_workers))
    return tuple(iterators)


def samples_per_split(settings: DataSettings) -> tuple[int, int, int]:
    """Samples each split must provide: every train step, every evaluation, the final test eval."""
    evaluations = settings.train_iters // settings.eval_interval + 1
    return (
        settings.train_iters * settings.train_batch_size,
        evaluations * settings.eval_iters * settings.train_batch_size,
        settings.eval_iters * settings.train_batch_size,
    )
