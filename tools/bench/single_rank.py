"""A one-rank gloo world with megatron-core's process groups, for benchmarks that build real engines."""

from __future__ import annotations

import os
import socket

import deepspeed
import torch.distributed as dist
from megatron.core import parallel_state


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_single_rank_world() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
