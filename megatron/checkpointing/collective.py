"""The few collectives checkpointing needs, also correct in a single process without torch.distributed."""

from __future__ import annotations

from typing import Any


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if _initialized() else (0, 1)


def barrier() -> None:
    import torch.distributed as dist

    if _initialized():
        dist.barrier()


def all_gather(value: Any) -> list[Any]:
    """Every rank's `value` (picklable), indexed by global rank."""
    import torch.distributed as dist

    if not _initialized() or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
