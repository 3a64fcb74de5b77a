"""GPT samples: seq_length + 1 consecutive tokens read across document boundaries (GPT-NeoX semantics).

Three index arrays, built once and cached (index_cache):
  doc_idx     documents of the split, shuffled per epoch, epochs concatenated
  sample_idx  (samples + 1, 2): where sample i starts as [position in doc_idx, token offset]; sample i
              ends where sample i + 1 starts, plus one token (consecutive samples share one token)
  shuffle_idx the order in which samples are served
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron.data.errors import DataError
from megatron.data.index_cache import load_or_build
from megatron.data.indexed_dataset import MMapIndexedDataset

INDEX_FORMAT_VERSION = 1


def build_sample_indices(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """doc_idx, sample_idx and shuffle_idx covering at least num_samples samples."""
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


class GPTDataset:
    """Item i: {"text": int64 array of seq_length + 1 tokens}; len() >= num_samples (whole epochs)."""

    def __init__(
        self,
        name: str,
        indexed_dataset: MMapIndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        index_cache_dir: str | Path | None = None,
    ):
        if len(documents) == 0 or np.any(np.diff(documents) != 1):
            raise DataError("GPTDataset documents must be a non-empty, contiguous range of document ids")
        tokens = int(indexed_dataset.sizes[documents].sum(dtype=np.int64))
        if tokens <= seq_length:
            raise DataError(
                f"the {name} split of {indexed_dataset.prefix!r} (documents {documents[0]}..{documents[-1]}) holds "
                f"{tokens} tokens, fewer than one sample of seq_length + 1 = {seq_length + 1}; give it more data "
                "(a larger share in `split`, or more documents) or use a shorter seq_length"
            )
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        settings = {
            "version": INDEX_FORMAT_VERSION,
            "split": name,
            "documents": [int(documents[0]), int(documents[-1]) + 1],
            "num_samples": int(num_samples),
            "seq_length": int(seq_length),
            "seed": int(seed),
        }
        arrays, self.built_index = load_or_build(
            indexed_dataset.prefix,
            name,
            settings,
            lambda: build_sample_indices(indexed_dataset.sizes, documents, num_samples, seq_length, seed),
            index_cache_dir,
        )
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        sample = int(self.shuffle_idx[idx])
        first_doc, first_offset = (int(v) for v in self.sample_idx[sample])
        last_doc, last_offset = (int(v) for v in self.sample_idx[sample + 1])
        data = self.indexed_dataset
        if first_doc == last_doc:
            tokens = data.get(int(self.doc_idx[first_doc]), first_offset, last_offset - first_offset + 1)
        else:
            pieces = [data.get(int(self.doc_idx[first_doc]), first_offset)]
            pieces += [data.get(int(self.doc_idx[d])) for d in range(first_doc + 1, last_doc)]
            pieces.append(data.get(int(self.doc_idx[last_doc]), 0, last_offset + 1))
            tokens = np.concatenate(pieces)
        return {"text": tokens.astype(np.int64)}
