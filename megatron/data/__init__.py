"""Mmap indexed datasets (.bin/.idx), GPT sample indexing, blending, resumable samplers, the embedded corpus.

Exports load on first use, so tools that only tokenize (preprocess_data.py and its workers) never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "build_data_iterators": "megatron.data.builders",
    "build_train_valid_test_datasets": "megatron.data.builders",
    "check_data_vocabulary": "megatron.data.data_vocabulary",
    "Batch": "megatron.data.batches",
    "BatchOptions": "megatron.data.batches",
    "get_batch": "megatron.data.batches",
    "pairwise_batch": "megatron.data.batches",
    "document_sums": "megatron.data.batches",
    "DataError": "megatron.data.errors",
    "MMapIndexedDataset": "megatron.data.indexed_dataset",
    "MMapIndexedDatasetBuilder": "megatron.data.indexed_dataset",
    "best_fitting_dtype": "megatron.data.indexed_dataset",
}

if TYPE_CHECKING:
    from megatron.data.batches import Batch, BatchOptions, document_sums, get_batch, pairwise_batch
    from megatron.data.builders import build_data_iterators, build_train_valid_test_datasets
    from megatron.data.data_vocabulary import check_data_vocabulary
    from megatron.data.errors import DataError
    from megatron.data.indexed_dataset import (
        MMapIndexedDataset,
        MMapIndexedDatasetBuilder,
        best_fitting_dtype,
    )

__all__ = [
    "Batch",
    "BatchOptions",
    "DataError",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "best_fitting_dtype",
    "build_data_iterators",
    "build_train_valid_test_datasets",
    "check_data_vocabulary",
    "document_sums",
    "get_batch",
    "pairwise_batch",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
