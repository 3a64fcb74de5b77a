"""Weighted blending of several datasets: exact per-dataset counts, spread evenly, deterministic."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron.data.errors import DataError


def normalize_weights(weights: Sequence[float], paths: Sequence[str], setting: str) -> np.ndarray:
    if len(weights) != len(paths):
        raise DataError(f"{setting} has {len(weights)} weights for {len(paths)} data paths; give one weight per path")
    try:
        array = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise DataError(f"{setting} {list(weights)} must be numbers, one per data path") from None
    if not np.isfinite(array).all() or (array < 0).any() or array.sum() <= 0:
        raise DataError(f"{setting} {list(weights)} must be finite and non-negative with a positive sum (each path's share of the samples)")
    return array / array.sum()


def samples_per_dataset(weights: np.ndarray, num_samples: int) -> np.ndarray:
    """Largest-remainder rounding: counts sum to num_samples and each is within one of weight x num_samples."""
    exact = weights * num_samples
    counts = np.floor(exact).astype(np.int64)
    remainder = num_samples - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:remainder]] += 1
    return counts


def blending_indices(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of sample i, sample within that dataset): dataset d's k-th sample sits at (k + 0.5) / counts[d]
    of the way through, so every prefix of the blend keeps the proportions to within about one sample each."""
    dataset_index = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    sample_index = np.concatenate([np.arange(c, dtype=np.int64) for c in counts]) if len(counts) else np.zeros(0, np.int64)
    position = (sample_index + 0.5) / np.repeat(np.maximum(counts, 1), counts)
    order = np.lexsort((dataset_index, position))
    return dataset_index[order], sample_index[order]


class BlendableDataset:
    """num_samples items drawn from `datasets` in proportion to `weights` (already normalised)."""

    def __init__(self, datasets: Sequence, weights: np.ndarray, num_samples: int):
        counts = samples_per_dataset(weights, num_samples)
        for dataset, count in zip(datasets, counts, strict=True):
            if len(dataset) < count:
                raise DataError(f"blended dataset {getattr(dataset, 'name', dataset)!r} has {len(dataset)} "
                                f"samples but its weight asks for {count}")
        self.datasets = list(datasets)
        self.counts = counts
        self.dataset_index, self.dataset_sample_index = blending_indices(counts)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        return self.datasets[self.dataset_index[idx]][int(self.dataset_sample_index[idx])]
