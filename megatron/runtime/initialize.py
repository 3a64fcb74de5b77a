"""Start-up of every rank: distributed backend, megatron-core process groups, seeds."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from megatron.foreign_notices import foreign_prints_hidden
from megatron.logging import slow_stage
from megatron.ranks import data_parallel_rank_and_size
from megatron.runtime.collective import barrier
from megatron.runtime.cpu_info import ask_cpu_info_early


def initialize_distributed(args) -> None:
    """DeepSpeed's process group (NCCL on GPU, gloo on CPU) and megatron-core's model-parallel groups."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    if not dist.is_initialized():
        _rank_environment_from_launcher(args.deepspeed_mpi, args.deepspeed_slurm, args.master_port)
        init_deepspeed_distributed()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.model_parallel_size,
            pipeline_model_parallel_size=max(args.pipe_parallel_size, 1),
            context_parallel_size=args.context_parallel_size,
        )
    world = dist.get_world_size()
    stages = max(args.pipe_parallel_size, 1)
    cp = args.context_parallel_size
    if args.data_parallel_size is not None and world != args.data_parallel_size * args.model_parallel_size * cp * stages:
        from megatron.neox_arguments import ConfigError

        raise ConfigError(
            f"the launcher started {world} ranks but the settings were validated for "
            f"data_parallel_size={args.data_parallel_size} x model_parallel_size={args.model_parallel_size} x "
            f"context_parallel_size={cp} x pipe_parallel_size={stages}; start the run through deepy.py so both agree"
        )


def init_deepspeed_distributed(**kwargs) -> None:
    """``deepspeed.init_distributed(**kwargs)``, then drop the names of DeepSpeed's shared-memory buffers.

    With all ranks on one CPU node, DeepSpeed's shared-memory allreduce creates one file per rank in
    /dev/shm and never removes it, so every run, and every killed one, would leave tens of MB of
    memory behind until the machine restarts. Each rank maps every rank's buffer before the init
    returns; after a barrier (so no rank still waits to open one) the names are no longer needed and
    the mappings live on until the processes end.
    """
    import deepspeed
    import torch.distributed as dist

    ask_cpu_info_early()  # train.py asked before its imports; any other rank asks here, before its engine
    with slow_stage("joining the process group (a first run on a CPU also builds DeepSpeed's communication op)"), \
            foreign_prints_hidden():
        deepspeed.init_distributed(verbose=False, **kwargs)
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    shm = Path("/dev/shm")
    if not (address and port and shm.is_dir()):
        return
    barrier()
    # DeepSpeed's name: deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>
    (shm / f"deepspeed_allreduce_buffer_{os.getuid()}_{address}_{port}_{dist.get_rank()}").unlink(missing_ok=True)


def leave_process_group() -> None:
    """Destroy the process groups of a rank that finished its work, before the interpreter ends.

    Left to the interpreter's teardown, gloo's worker threads can abort the process ("terminate called
    without an active exception", exit -6) after a run that succeeded (pytorch/pytorch#190489). Only for a
    rank that finished: destroying a group waits for its pending work, which after an error could wait for
    peers that never come, where exiting lets them fail on the closed connection.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _rank_environment_from_launcher(deepspeed_mpi: bool, deepspeed_slurm: bool, master_port: int | None) -> None:
    """deepspeed_slurm / deepspeed_mpi: ranks started by srun or mpirun learn rank and world size
    from SLURM's or MPI's environment, as GPT-NeoX sets them up."""
    if deepspeed_mpi:
        from deepspeed.comm import mpi_discovery

        mpi_discovery(distributed_port=master_port)
    if deepspeed_slurm:
        os.environ["LOCAL_RANK"] = os.environ["SLURM_LOCALID"]
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS") or str(
            int(os.environ["SLURM_NNODES"]) * int(os.environ["SLURM_NTASKS_PER_NODE"]))


def set_seeds(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class ModelParallelUnit:
    """The process groups DeepSpeed asks its ``mpu`` for, from megatron-core's parallel_state.

    The model-parallel group is the tensor-parallel group (no pipeline stages), so ZeRO partitions
    and reduces gradients over the data-parallel group only, saves one ``mp_rank_<MP>`` file per
    tensor-parallel rank, and sums gradient norms over the tensor-parallel group (split parameters
    carry megatron-core's ``tensor_model_parallel`` attribute; replicated ones count once).

    Context parallelism is DeepSpeed's "sequence parallel" interface (the one its Ulysses uses): the batch size
    counts the data-parallel ranks, while ZeRO partitions over, and the gradients are summed over the
    context-parallel ranks and averaged over the data-parallel ranks of, the data x context group
    (``get_sequence_data_parallel_group``). Each context-parallel rank's loss is its tokens' share of the
    sequence's loss (megatron/model/context_parallel.py), so the sum is the sequence's gradient.
    """

    @staticmethod
    def get_model_parallel_rank() -> int:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_rank()

    @staticmethod
    def get_model_parallel_world_size() -> int:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_world_size()

    @staticmethod
    def get_model_parallel_group():
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    @staticmethod
    def get_tensor_model_parallel_src_rank() -> int:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_src_rank()

    @staticmethod
    def get_data_parallel_rank() -> int:
        return data_parallel_rank_and_size()[0]

    @staticmethod
    def get_data_parallel_world_size() -> int:
        return data_parallel_rank_and_size()[1]

    @staticmethod
    def get_data_parallel_group():
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @staticmethod
    def get_sequence_parallel_world_size() -> int:
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_world_size()

    @staticmethod
    def get_sequence_parallel_rank() -> int:
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_rank()

    @staticmethod
    def get_sequence_parallel_group():
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    @staticmethod
    def get_sequence_data_parallel_world_size() -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size(with_context_parallel=True)

    @staticmethod
    def get_sequence_data_parallel_rank() -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(with_context_parallel=True)

    @staticmethod
    def get_sequence_data_parallel_group():
        """The data x context group; the data-parallel group itself without context parallelism."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group(
            with_context_parallel=parallel_state.get_context_parallel_world_size() > 1)


def zero3_construction(ds_config: dict):
    """The ``deepspeed.zero.Init`` context a ZeRO-3 model is built in (``build_model(partitioned_by=...)``):
    every parameter is partitioned over the data-parallel (x context-parallel) group, as the engine will keep it."""
    import deepspeed

    mpu = ModelParallelUnit()
    return deepspeed.zero.Init(config_dict_or_path=ds_config, mpu=mpu,
                               data_parallel_group=mpu.get_sequence_data_parallel_group())


def current_device() -> torch.device:
    """The device this rank computes on (its GPU, or the CPU)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())
