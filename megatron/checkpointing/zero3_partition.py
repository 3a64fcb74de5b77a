"""How ZeRO-3 splits one parameter over the ranks of its partition group.

A parameter of n elements is cut into P equal partitions of ceil(n / P) elements, one per rank;
rank r holds elements [r * size, (r + 1) * size) of the flattened parameter, and the elements at or
past n are padding (only the last ranks have any). The saved fp32 partitions follow the same rule.
"""

from __future__ import annotations

import math


def partition_numel(numel: int, group_size: int) -> int:
    """Elements of each rank's partition, padding included."""
    return math.ceil(numel / group_size)


def owned_range(rank: int, partition_size: int, numel: int) -> tuple[int, int]:
    """(start in the flattened parameter, real elements) of `rank`'s partition; the rest is padding."""
    start = rank * partition_size
    return start, max(0, min(partition_size, numel - start))
