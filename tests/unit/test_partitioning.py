"""The fused QKV weight's split with fewer key/value heads than tensor-parallel ranks: each rank holds
its query heads and the key and value head they use; parts move between sizes without losing a row."""

from __future__ import annotations

import pytest
import torch

from megatron.model.partitioning import partition, partitioning, repartition
from megatron.neox_arguments import NeoXArgs

QKV = "sequential.2.attention.query_key_value.weight"


def qkv_partitioning(kv_heads: int):
    arch = NeoXArgs.from_dict(dict(num_layers=1, hidden_size=8, num_attention_heads=4, num_kv_heads=kv_heads,
                                   seq_length=4, padded_vocab_size=16, norm="rmsnorm")).architecture()
    return partitioning(QKV, arch)


def labelled(rows: int) -> torch.Tensor:
    """Row i holds i in both columns (head_dim 2 -> rows 2h, 2h+1 are head h's)."""
    return torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 2).clone()


def heads(part: torch.Tensor) -> list[int]:
    """The full-tensor head index (row // 2) of each 2-row head in ``part``."""
    return [int(part[i, 0]) // 2 for i in range(0, part.shape[0], 2)]


# Full heads: queries 0-3, then keys (4.. ), then values; 2 rows per head.
@pytest.mark.parametrize(("kv_heads", "size", "expected"), [
    (1, 2, [[0, 1, 4, 5], [2, 3, 4, 5]]),
    (1, 4, [[0, 4, 5], [1, 4, 5], [2, 4, 5], [3, 4, 5]]),
    (2, 4, [[0, 4, 6], [1, 4, 6], [2, 5, 7], [3, 5, 7]]),
    (2, 2, [[0, 1, 4, 6], [2, 3, 5, 7]]),
])
def test_each_rank_holds_its_query_heads_and_the_key_value_head_they_use(kv_heads, size, expected):
    p = qkv_partitioning(kv_heads)
    full = labelled((4 + 2 * kv_heads) * 2)
    assert [heads(partition(full, p, rank, size)) for rank in range(size)] == expected


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize(("saved", "size"), [(2, 1), (4, 1), (1, 4), (2, 4), (4, 2)])
def test_parts_move_between_sizes_exactly(kv_heads, saved, size):
    p = qkv_partitioning(kv_heads)
    full = labelled((4 + 2 * kv_heads) * 2)
    parts = [partition(full, p, rank, saved).clone() for rank in range(saved)]
    for rank in range(size):
        assert torch.equal(repartition(parts, p, rank, size), partition(full, p, rank, size))
    assert torch.equal(repartition(parts, p, 0, 1), full)


def test_three_ranks_cannot_share_two_key_value_heads():
    with pytest.raises(ValueError, match="2 heads cannot be shared evenly by 3 tensor-parallel ranks"):
        partition(labelled(16), qkv_partitioning(2), 0, 3)
