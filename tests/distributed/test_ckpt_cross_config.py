"""A checkpoint saved with one DP size, ZeRO stage and precision fine-tunes under another.

    fp32 ZeRO-0 on 2 ranks -> bf16 ZeRO-3 on 1 rank
    bf16 ZeRO-2 on 1 rank  -> fp16 ZeRO-1 on 2 ranks

Each load goes save_checkpoint -> plan_load -> load_checkpoint, then one optimizer step at learning
rate 0: the training-dtype weights must equal the checkpoint's (cast) bit for bit and the fp32 master
weights the checkpoint's values.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.ckpt_engines import (
    DTYPES,
    bits_equal,
    build_engine,
    make_args,
    master_weights,
    set_lr,
    tiny_batch,
    train_step,
    training_weights,
)
from tests.conftest import declare_cpu_fp16_capable, free_port

pytestmark = pytest.mark.distributed

EXPECTED = "expected.pt"


def save_trained(args, steps: int = 2, rank: int = 0) -> dict[str, torch.Tensor]:
    """Train `steps` steps (each rank its own batches), save, and return the saved weights in fp32."""
    from megatron.checkpointing import save_checkpoint

    engine = build_engine(args, seed=0)
    for step in range(1, steps + 1):
        train_step(engine, tiny_batch(args, 100 * rank + step))
    save_checkpoint(args, engine, steps, consumed_train_samples=2 * steps)
    return {name: value.float() for name, value in training_weights(engine).items()}


def finetune_and_check(args, data_parallel_size: int, expected: dict[str, torch.Tensor], rank: int = 0) -> None:
    from megatron.checkpointing import load_checkpoint, plan_load

    plan = plan_load(args, data_parallel_size)
    assert plan.module_only and all("optim_states" not in path.name for path in plan.files)
    engine = build_engine(args, seed=1)  # other initial weights: only the load can make them equal
    load_checkpoint(engine, plan)
    set_lr(engine, 0.0)
    train_step(engine, tiny_batch(args, 500 + rank))
    dtype = DTYPES[args.precision]
    weights, masters = training_weights(engine), master_weights(engine)
    assert set(weights) == set(expected)
    for name, value in expected.items():
        assert bits_equal(weights[name], value.to(dtype)), f"rank {rank}: training weights of {name}"
        assert bits_equal(masters[name], value), f"rank {rank}: fp32 master of {name}"


def _rank_main(rank: int, port: int, phase: str, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_SIZE="2")
    from megatron.initialize import init_deepspeed_distributed, leave_process_group

    init_deepspeed_distributed(dist_backend="gloo")
    if phase == "save fp32 zero0":
        expected = save_trained(make_args(stage=0, precision="fp32", save=root), rank=rank)
        if rank == 0:
            torch.save(expected, Path(root) / EXPECTED)
    elif phase == "finetune fp16 zero1":
        declare_cpu_fp16_capable()
        args = make_args(stage=1, precision="fp16", load=root, finetune=True)
        finetune_and_check(args, 2, torch.load(Path(root) / EXPECTED), rank=rank)
    torch.distributed.barrier()
    leave_process_group()


def _on_two_ranks(phase: str, root: Path) -> None:
    mp.spawn(_rank_main, args=(free_port(), phase, str(root)), nprocs=2, join=True)


def test_fp32_zero0_on_two_ranks_finetunes_in_bf16_zero3_on_one(single_rank_world, tmp_path):
    _on_two_ranks("save fp32 zero0", tmp_path)
    expected = torch.load(tmp_path / EXPECTED)
    finetune_and_check(make_args(stage=3, precision="bf16", load=str(tmp_path), finetune=True), 1, expected)


def test_bf16_zero2_on_one_rank_finetunes_in_fp16_zero1_on_two(single_rank_world, tmp_path):
    expected = save_trained(make_args(stage=2, precision="bf16", save=str(tmp_path)))
    torch.save(expected, tmp_path / EXPECTED)
    _on_two_ranks("finetune fp16 zero1", tmp_path)
