"""The few collectives outside the training step: a barrier, gathering one value from every rank, and
agreeing across ranks on what some of them found. Also correct in a single process without
torch.distributed."""

from __future__ import annotations

from typing import Any, TypeVar

from megatron.ranks import rank_and_world

T = TypeVar("T")


def barrier() -> None:
    import torch.distributed as dist

    if rank_and_world()[1] > 1:
        dist.barrier()


def all_gather(value: Any) -> list[Any]:
    """Every rank's `value` (picklable), indexed by global rank."""
    import torch.distributed as dist

    world = rank_and_world()[1]
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def reported_by_ranks(value: T | None) -> list[tuple[int, T]]:
    """(rank, value) of every rank whose `value` is not None, in rank order: the same list on every rank,
    so every rank takes the same decision from it. A collective."""
    return [(rank, reported) for rank, reported in enumerate(all_gather(value)) if reported is not None]
