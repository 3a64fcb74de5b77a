"""How ZeRO-3 splits one parameter over the ranks of its partition group, and writing a whole value into it.

A parameter of n elements is cut into P equal partitions of ceil(n / P) elements, one per rank;
rank r holds elements [r * size, (r + 1) * size) of the flattened parameter, and the elements at or
past n are padding (only the last ranks have any). The saved fp32 partitions follow the same rule.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


def partition_numel(numel: int, group_size: int) -> int:
    """Elements of each rank's partition, padding included."""
    return math.ceil(numel / group_size)


def owned_range(rank: int, partition_size: int, numel: int) -> tuple[int, int]:
    """(start in the flattened parameter, real elements) of `rank`'s partition; the rest is padding."""
    start = rank * partition_size
    return start, max(0, min(partition_size, numel - start))


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter (its values live in ``ds_tensor``, one partition per rank)."""
    return hasattr(param, "ds_id")


def write_whole_value(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write this rank's partition of ``value`` (the whole parameter) into ZeRO-3 parameter ``param``.

    Only this rank's elements of ``value`` are read, so a memory-mapped ``value`` costs one partition.
    The last rank's padding is left as it is. A parameter that is currently whole on every rank
    (ZeRO-3 keeps small ones "persistent") also gets its full copy written, or the forward pass would
    keep using the old values.
    """
    partition = param.ds_tensor.data.view(-1)
    start, owned = owned_range(dist.get_rank(group=getattr(param, "ds_process_group", None)), partition.numel(),
                               param.ds_numel)
    partition.narrow(0, 0, owned).copy_(value.reshape(-1).narrow(0, start, owned))
    if param.ds_status == ZeroParamStatus.AVAILABLE:
        param.data.copy_(value.view(param.ds_shape))
