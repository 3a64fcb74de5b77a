"""Mmap indexed datasets (.bin/.idx), GPT sample indexing, blending, resumable samplers, the embedded corpus."""

from megatron.data.builders import build_data_iterators, build_train_valid_test_datasets, get_batch
from megatron.data.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, best_fitting_dtype

__all__ = [
    "DataError",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "best_fitting_dtype",
    "build_data_iterators",
    "build_train_valid_test_datasets",
    "get_batch",
]
