"""Batch samplers that start at any global sample (resume) and give each data-parallel rank its shard."""

from __future__ import annotations

from collections.abc import Iterator

from megatron.data.errors import DataError


class DistributedBatchSampler:
    """Global batches of micro_batch_size x data_parallel_size consecutive sample indices, starting at
    consumed_samples; rank r receives slice [r x micro, (r + 1) x micro) of each. With `cycle` the indices
    wrap around the dataset forever (evaluation), otherwise iteration stops before an incomplete batch."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        cycle: bool = False,
    ):
        if total_samples <= 0:
            raise DataError("a batch sampler needs a dataset with at least one sample")
        if micro_batch_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise DataError(f"invalid sampler layout: micro batch {micro_batch_size}, "
                            f"rank {data_parallel_rank} of {data_parallel_size}")
        if not cycle and consumed_samples > total_samples:
            raise DataError(f"consumed_samples {consumed_samples} is beyond the {total_samples} samples of "
                            "the training dataset; the run was resumed with fewer train_iters or other data")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_batch_size = micro_batch_size * data_parallel_size
        self.cycle = cycle

    def __len__(self) -> int:
        if self.cycle:
            raise TypeError("a cycling sampler has no length")
        return (self.total_samples - self.consumed_samples) // self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        batch_start = self.consumed_samples
        while self.cycle or batch_start + self.global_batch_size <= self.total_samples:
            first = batch_start + self.data_parallel_rank * self.micro_batch_size
            yield [(first + i) % self.total_samples for i in range(self.micro_batch_size)]
            batch_start += self.global_batch_size
