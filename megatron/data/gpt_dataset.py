"""GPT samples of seq_length + 1 tokens, built the three GPT-NeoX ways (`pack_impl`), labels riding along.

Three index arrays, built once and cached (index_cache):
  doc_idx     documents in the order samples read them
  sample_idx  (samples + 1, 2): where sample i starts as [position in doc_idx, token offset]; sample i
              ends where sample i + 1 starts, plus one token (consecutive samples share one token)
  shuffle_idx the order in which samples are served

packed               documents shuffled per epoch and concatenated, cut every seq_length tokens
pack_until_overflow  whole documents, shuffled, appended to a sample until the next would overflow
unpacked             one document per sample, in document order, the samples shuffled
In the last two a sample is its documents, then the first token of the next sample's first document
(GPT-NeoX's one-token overlap), cut or padded to seq_length + 1; a document whose labels are all
masked is skipped, and with allow_chopped false so is one longer than seq_length + 1.

With a label dataset (aligned with the tokens, negative where the loss is masked) every item has
"text" and "label"; the non-packed modes always give "label" (the tokens themselves when there is no
label file), -100 on padding, so padding is never trained.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron.data.errors import DataError
from megatron.data.index_cache import data_fingerprint, load_or_build
from megatron.data.indexed_dataset import MMapIndexedDataset

INDEX_FORMAT_VERSION = 2
PACK_IMPLS = ("packed", "pack_until_overflow", "unpacked")
PAD_TOKEN, PAD_LABEL = 0, -100


def build_sample_indices(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """packed: doc_idx, sample_idx and shuffle_idx covering at least num_samples samples."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    # Every sample consumes seq_length tokens and needs one more token after them.
    num_epochs = -(-(num_samples * seq_length + 1) // tokens_per_epoch)
    rng = np.random.RandomState(seed)
    doc_idx = np.concatenate([rng.permutation(documents) for _ in range(num_epochs)]).astype(np.int32)
    ends = np.cumsum(sizes[doc_idx].astype(np.int64))
    total_samples = (int(ends[-1]) - 1) // seq_length
    starts = np.arange(total_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(ends, starts, side="right")
    offsets = starts - np.concatenate([[0], ends])[positions]
    sample_idx = np.stack([positions, offsets], axis=1).astype(np.int64)
    shuffle_idx = rng.permutation(total_samples).astype(np.int64)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def build_unpacked_indices(usable: np.ndarray, documents: np.ndarray, num_samples: int, seed: int) -> dict[str, np.ndarray]:
    """unpacked: sample i is the i-th usable document, cycling through the documents in order."""
    rng = np.random.RandomState(seed)
    shuffle_idx = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(shuffle_idx)
    doc_idx = np.resize(documents[usable], num_samples + 1).astype(np.int64)  # +1: the borrowed next token
    sample_idx = np.stack([np.arange(num_samples + 1), np.zeros(num_samples + 1)], axis=1).astype(np.int64)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def build_overflow_indices(
    sizes: np.ndarray, usable: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """pack_until_overflow: documents visited in a shuffled order (reshuffled after every pass), each
    appended to the current sample unless it would make it longer than seq_length + 1."""
    rng = np.random.RandomState(seed)
    shuffle_idx = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(shuffle_idx)
    order = np.arange(len(documents))
    rng.shuffle(order)
    doc_idx: list[int] = []
    sample_starts: list[int] = []
    running = 0
    position = 0
    while len(sample_starts) < num_samples:
        local = order[position]
        if usable[local]:
            length = int(sizes[documents[local]])
            if running == 0 or running + length > seq_length + 1:
                sample_starts.append(len(doc_idx))
                running = length
            else:
                running += length
            doc_idx.append(int(documents[local]))
        position += 1
        if position == len(documents):
            position = 0
            rng.shuffle(order)
    sample_starts.append(len(doc_idx))
    sample_idx = np.stack([np.asarray(sample_starts), np.zeros(len(sample_starts))], axis=1).astype(np.int64)
    return {"doc_idx": np.asarray(doc_idx, dtype=np.int64), "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def usable_documents(
    sizes: np.ndarray, documents: np.ndarray, label_dataset: MMapIndexedDataset | None, label_window: int,
    longest: int | None,
) -> np.ndarray:
    """Per document of `documents`: not longer than `longest` (None: any length) and with a trained label
    among its first `label_window` labels."""
    usable = np.ones(len(documents), dtype=bool)
    if longest is not None:
        usable &= sizes[documents] <= longest
    if label_dataset is not None:
        for i, doc in enumerate(documents):
            if usable[i]:
                usable[i] = bool((label_dataset.get(int(doc), 0, min(label_window, int(sizes[doc]))) >= 0).any())
    return usable


class GPTDataset:
    """Item i: {"text": int64[seq_length + 1]} (and "label", see the module doc); len() >= num_samples."""

    def __init__(
        self,
        name: str,
        indexed_dataset: MMapIndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        index_cache_dir: str | Path | None = None,
        pack_impl: str = "packed",
        allow_chopped: bool = True,
        label_dataset: MMapIndexedDataset | None = None,
    ):
        if len(documents) == 0 or np.any(np.diff(documents) != 1):
            raise DataError("GPTDataset documents must be a non-empty, contiguous range of document ids")
        if pack_impl not in PACK_IMPLS:
            raise DataError(f"pack_impl {pack_impl!r} is not one of {PACK_IMPLS}")
        sizes = indexed_dataset.sizes
        if label_dataset is not None and not np.array_equal(label_dataset.sizes, sizes):
            raise DataError(
                f"label dataset {label_dataset.prefix!r} does not match {indexed_dataset.prefix!r}: "
                f"{len(label_dataset)} and {len(sizes)} documents, or documents of other lengths; give each data "
                "path the label file written with it (preprocess_data_with_chat_template.py writes both)")
        tokens = int(sizes[documents].sum(dtype=np.int64))
        if pack_impl == "packed" and tokens <= seq_length:
            raise DataError(
                f"the {name} split of {indexed_dataset.prefix!r} (documents {documents[0]}..{documents[-1]}) holds "
                f"{tokens} tokens, fewer than one sample of seq_length + 1 = {seq_length + 1}; give it more data "
                "(a larger share in `split`, or more documents) or use a shorter seq_length"
            )
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.label_dataset = label_dataset
        self.seq_length = seq_length
        self.pads = pack_impl != "packed"
        settings = {
            "version": INDEX_FORMAT_VERSION,
            "split": name,
            "documents": [int(documents[0]), int(documents[-1]) + 1],
            "num_samples": int(num_samples),
            "seq_length": int(seq_length),
            "seed": int(seed),
            "pack_impl": pack_impl,
        }
        if self.pads:
            settings["allow_chopped"] = bool(allow_chopped)
            settings["labels"] = data_fingerprint(label_dataset.prefix) if label_dataset is not None else None
        arrays, self.built_index = load_or_build(
            indexed_dataset.prefix,
            name,
            settings,
            lambda: self._build(sizes, documents, num_samples, seq_length, seed, pack_impl, allow_chopped),
            index_cache_dir,
        )
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def _build(self, sizes, documents, num_samples, seq_length, seed, pack_impl, allow_chopped):
        if pack_impl == "packed":
            return build_sample_indices(sizes, documents, num_samples, seq_length, seed)
        # GPT-NeoX's windows of the label check: unpacked looks at the first seq_length labels,
        # pack_until_overflow at seq_length + 1.
        window = seq_length if pack_impl == "unpacked" else seq_length + 1
        usable = usable_documents(sizes, documents, self.label_dataset, window,
                                  None if allow_chopped else seq_length + 1)
        if not usable.any():
            raise DataError(
                f"the {self.name} split of {self.indexed_dataset.prefix!r} has no document to sample with pack_impl "
                f"{pack_impl}: every one is " + ("longer than seq_length + 1 or " if not allow_chopped else "")
                + "without a trained label; use allow_chopped: true, a longer seq_length, or other data")
        if pack_impl == "unpacked":
            return build_unpacked_indices(usable, documents, num_samples, seed)
        return build_overflow_indices(sizes, usable, documents, num_samples, seq_length, seed)

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def _read(self, data: MMapIndexedDataset, sample: int) -> np.ndarray:
        first_doc, first_offset = (int(v) for v in self.sample_idx[sample])
        last_doc, last_offset = (int(v) for v in self.sample_idx[sample + 1])
        if first_doc == last_doc:
            return data.get(int(self.doc_idx[first_doc]), first_offset, last_offset - first_offset + 1)
        pieces = [data.get(int(self.doc_idx[first_doc]), first_offset)]
        pieces += [data.get(int(self.doc_idx[d])) for d in range(first_doc + 1, min(last_doc, len(self.doc_idx)))]
        if last_doc < len(self.doc_idx):  # the last overflow sample has no next document to borrow from
            pieces.append(data.get(int(self.doc_idx[last_doc]), 0, min(last_offset + 1, int(data.sizes[self.doc_idx[last_doc]]))))
        return np.concatenate(pieces)

    def _fit(self, values: np.ndarray, pad: int) -> np.ndarray:
        values = values[: self.seq_length + 1].astype(np.int64)
        return np.pad(values, (0, self.seq_length + 1 - len(values)), constant_values=pad)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        sample = int(self.shuffle_idx[idx])
        text = self._read(self.indexed_dataset, sample)
        if not self.pads and self.label_dataset is None:
            return {"text": text.astype(np.int64)}
        labels = text if self.label_dataset is None else self._read(self.label_dataset, sample)
        return {"text": self._fit(text, PAD_TOKEN), "label": self._fit(labels, PAD_LABEL)}
