"""Two CPU ranks: per-rank RNG states and per-rank optimizer shards survive save -> plan -> load."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2


def _full_weights(engine) -> dict[str, torch.Tensor]:
    from deepspeed import zero

    with zero.GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def _rank_main(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE))
    from megatron.checkpointing import load_checkpoint, plan_load, save_checkpoint
    from megatron.checkpointing.ondisk.inventory import inventory_checkpoint
    from megatron.initialize import init_deepspeed_distributed, leave_process_group
    from tests.ckpt_engines import build_engine, make_args, tiny_batch, train_step

    init_deepspeed_distributed(dist_backend="gloo")
    args = make_args(stage=2, precision="bf16", save=root, load=root)

    def step(engine, iteration):  # each rank its own batch
        train_step(engine, tiny_batch(args, 100 * rank + iteration))

    original = build_engine(args, seed=0)
    torch.manual_seed(10 + rank)  # dropout differs per rank, as in training
    for iteration in (1, 2):
        step(original, iteration)
    save_checkpoint(args, original, 2, consumed_train_samples=8)
    step(original, 3)
    expected = _full_weights(original)

    plan = plan_load(args, data_parallel_size=WORLD_SIZE)
    assert plan.load_optimizer and plan.restore_rng
    resumed = build_engine(args, seed=1)
    torch.manual_seed(999)  # the same on both ranks: only a per-rank restore gives back the masks
    outcome = load_checkpoint(resumed, plan)
    assert (outcome.iteration, outcome.consumed_train_samples) == (2, 8)
    step(resumed, 3)
    for name, value in _full_weights(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=f"rank {rank}: {name}")

    if rank == 0:
        tag = inventory_checkpoint(root).tags["global_step2"]
        assert tag.optimizer_dp_ranks == (0, 1) and tag.saved_layout.data_parallel == 2
        assert len(tag.metadata.client_state.rng_states) == WORLD_SIZE
        assert "resharded from DP 2 x TP 1, ZeRO-2 to DP 1 x TP 1, ZeRO-2" in plan_load(args, 1).describe()
        finetune = make_args(stage=2, precision="bf16", load=root, finetune=True)
        assert plan_load(finetune, data_parallel_size=1).module_only
    torch.distributed.barrier()
    leave_process_group()


def test_two_rank_resume_restores_each_ranks_rng_and_shards(tmp_path):
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path / "checkpoints")), nprocs=WORLD_SIZE, join=True)
