"""Which token ids a dataset (and a label file) holds, checked against the model's vocabulary before training.

preprocess_data.py writes `<prefix>.meta.json` next to the .bin/.idx: the vocabulary size of the
tokenizer that made the data and the largest token id in it, with the size and modification time
of both files. The record is believed only while those still match (the fingerprint the sample
index cache uses), so a record left behind by other data, or by these files before they were
rewritten or copied, is stale: the largest id is then computed from the .bin once and cached like
the sample indices (megatron/data/index_cache.py), as for data without a record (made by GPT-NeoX
or an older version). The vocabulary size is then unknown, so only the ids are checked. The smallest id
is computed with it: a token id is never negative (a label is, where the loss is masked), and a record
means the ids came from a tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron.data.data_settings import DataSettings
from megatron.data.errors import DataError
from megatron.data.index_cache import data_fingerprint, load_or_build
from megatron.data.indexed_dataset import MMapIndexedDataset, index_file_path
from megatron.fsio import write_text_atomically


def record_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.meta.json")


def write_vocabulary_record(prefix: str | Path, vocab_size: int, max_token_id: int, tokenizer_type: str) -> None:
    """Call once the .bin and .idx are complete: the record is only believed for these very files."""
    record = {"tokenizer_type": tokenizer_type, "vocab_size": int(vocab_size), "max_token_id": int(max_token_id),
              "data": data_fingerprint(str(prefix))}
    write_text_atomically(record_path(prefix), json.dumps(record, indent=1) + "\n")


def read_vocabulary_record(prefix: str | Path) -> dict | None:
    """The record written with the data, or None when there is none or it is stale (the files changed since)."""
    try:
        record = json.loads(record_path(prefix).read_text())
        if record["data"] != data_fingerprint(str(prefix)):
            return None
        return {"vocab_size": int(record["vocab_size"]), "max_token_id": int(record["max_token_id"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def token_id_range(data: MMapIndexedDataset) -> tuple[int, int, int | None]:
    """(smallest id, largest id, vocabulary size the data was made with or None when not recorded)."""
    prefix = data.prefix
    record = read_vocabulary_record(prefix)
    if record is not None:
        return 0, record["max_token_id"], record["vocab_size"]  # a tokenizer's ids: none is negative
    arrays, _ = load_or_build(str(prefix), "token_id_range", {},
                              lambda: {"range": np.array(data.id_range(), dtype=np.int64)})
    smallest, largest = (int(value) for value in arrays["range"])
    return smallest, largest, None


def dataset_prefixes(settings: DataSettings) -> list[tuple[str, str]]:
    """(setting, prefix) of every dataset of token ids the run reads."""
    if settings.data_path:
        return [("data_path", settings.data_path)]
    return _prefixes_of(settings, "data_paths")


def label_prefixes(settings: DataSettings) -> list[tuple[str, str]]:
    """(setting, prefix) of every label file the run reads."""
    return _prefixes_of(settings, "label_data_paths")


def _prefixes_of(settings: DataSettings, suffix: str) -> list[tuple[str, str]]:
    names = [f"{sign}{split}_{suffix}" for split in ("train", "valid", "test") for sign in ("", "pos_", "neg_")]
    return [(f"{name}[{i}]", prefix) for name in names for i, prefix in enumerate(getattr(settings, name) or [])]


def check_data_vocabulary(args, tokenizer_vocab_size: int) -> None:
    """`check_vocabulary` of the data settings of the run's settings `args`."""
    check_vocabulary(DataSettings.from_args(args), tokenizer_vocab_size)


def check_vocabulary(settings: DataSettings, tokenizer_vocab_size: int) -> None:
    """Raise DataError when a dataset is empty, or a dataset or label file was made with another tokenizer or holds
    ids the model has no row for (a negative token id included). Once per file before training: each file's largest id is recorded or cached."""
    tokenizer = f"the tokenizer ({settings.tokenizer_type}, vocab_file {settings.vocab_file})"
    rebuild = ("the data was made with another tokenizer: train with that one, or rebuild the data with "
               "tools/datasets/preprocess_data.py")
    relabel = ("labels are token ids, negative where the loss is masked: rebuild them with this tokenizer "
               "(tools/datasets/preprocess_data_with_chat_template.py writes the labels with the data)")
    files = [("dataset", "token id", rebuild, *entry) for entry in dataset_prefixes(settings)]
    files += [("label file", "label id", relabel, *entry) for entry in label_prefixes(settings)]
    for kind, id_name, fix, setting, prefix in files:
        data = MMapIndexedDataset(prefix, setting=setting)
        if kind == "dataset" and not data.sizes.sum():
            raise DataError(
                f"{setting}: dataset {prefix} holds no tokens ({len(data)} documents in {index_file_path(prefix)}); "
                "re-run tools/datasets/preprocess_data.py on input with text, or remove it from the run's data"
            )
        smallest, largest, made_with = token_id_range(data)
        if made_with is not None and made_with != tokenizer_vocab_size:
            raise DataError(
                f"{setting}: {kind} {prefix} was made with a tokenizer of {made_with} tokens "
                f"({record_path(prefix).name}), but {tokenizer} has {tokenizer_vocab_size}; train with the tokenizer "
                "the data was made with, or rebuild the data with tools/datasets/preprocess_data.py and this one"
            )
        low = 0 if kind == "dataset" else None  # a negative label is a masked one
        if largest < settings.padded_vocab_size and (low is None or smallest >= low):
            continue
        document, position, value = data.first_id_outside(low, settings.padded_vocab_size)
        if value < 0:
            raise DataError(
                f"{setting}: {kind} {prefix} holds {id_name} {value} (document {document}, position {position}); a "
                "token id is a row of the vocabulary, never negative, so the file is damaged or was not written from a "
                "tokenizer's ids: rebuild it with tools/datasets/preprocess_data.py"
            )
        raise DataError(
            f"{setting}: {kind} {prefix} holds {id_name} {value} (document {document}, position {position}), but "
            f"the model has {settings.padded_vocab_size} vocabulary rows ({tokenizer} has {tokenizer_vocab_size} "
            f"tokens, padded to a multiple of make_vocab_size_divisible_by); {fix}"
        )
