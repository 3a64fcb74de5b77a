"""Start-up of every rank: distributed backend, megatron-core process groups, seeds."""

from __future__ import annotations

import random

import numpy as np
import torch


def initialize_distributed(args) -> None:
    """DeepSpeed's process group (NCCL on GPU, gloo on CPU) and megatron-core's model-parallel groups."""
    import deepspeed
    import torch.distributed as dist

    from megatron.core import parallel_state

    if not dist.is_initialized():
        deepspeed.init_distributed(verbose=False)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.model_parallel_size,
            pipeline_model_parallel_size=max(args.pipe_parallel_size, 1),
        )
    world = dist.get_world_size()
    if args.data_parallel_size is not None and world != args.data_parallel_size * args.model_parallel_size:
        from megatron.neox_arguments import ConfigError

        raise ConfigError(
            f"the launcher started {world} ranks but the settings were validated for "
            f"data_parallel_size={args.data_parallel_size} x model_parallel_size={args.model_parallel_size}; "
            "start the run through deepy.py so both agree"
        )


def set_seeds(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def data_parallel_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def current_device() -> torch.device:
    """The device this rank computes on (its GPU, or the CPU)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())
