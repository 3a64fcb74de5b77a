"""A gloo world of benchmark processes on this machine, with megatron-core's process groups."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from megatron.core import parallel_state

from megatron.initialize import init_deepspeed_distributed, leave_process_group
from megatron.launcher import free_port


def init_world(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port or free_port())
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world_size),
                        ("LOCAL_SIZE", world_size)):
        os.environ[name] = str(value)
    if not dist.is_initialized():
        accelerator = get_accelerator()
        on_cpu = accelerator.device_name() == "cpu"
        init_deepspeed_distributed(dist_backend="gloo" if on_cpu else accelerator.communication_backend_name())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def leaves_the_world(rank_main: Callable) -> Callable:
    """``rank_main`` (what a bench runs on each rank), destroying the rank's process groups once it returned: a
    finished gloo rank left to the interpreter's teardown can abort (pytorch#190489), failing the bench after
    its work (leave_process_group; a rank that raised keeps them)."""

    @functools.wraps(rank_main)
    def run(*args, **kwargs):
        result = rank_main(*args, **kwargs)
        leave_process_group()
        return result

    return run
