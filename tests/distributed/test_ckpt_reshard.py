"""A full resume at another shape (megatron/checkpointing/loading/reshard.py), on 2 CPU ranks: see tests/distributed/reshard_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.checkpointing.ondisk.client_state import ClientState
from megatron.checkpointing.planning.data_position import PositionSettings, data_position
from megatron.checkpointing.planning.shape import Shape, ShapeChange
from megatron.data.samplers import DistributedBatchSampler
from tests.ckpt_engines import make_args
from tests.conftest import run_rank_worker
from tests.worker_report import reported

WORKER = Path(__file__).with_name("reshard_worker.py")


@pytest.mark.distributed
@pytest.mark.slow
def test_resharded_resume_restores_every_master_and_moment_bit_exact(tmp_path):
    records = run_rank_worker(WORKER, str(tmp_path), timeout=900)
    for case in ("neox fp32", "neox bf16", "llama fp32", "llama bf16", "bf16 to fp32"):
        assert reported(records, case=case, ok=True), records
    assert reported(records, case="unrestored moment", caught=True), records


GLOBAL_BATCH = 8


def samples_per_step(consumed: int, micro: int, data_parallel: int, steps: int) -> list[list[int]]:
    """The sample indices each step reads, over all data-parallel ranks and accumulation steps."""
    ranks = [iter(DistributedBatchSampler(10**4, consumed, micro, rank, data_parallel)) for rank in range(data_parallel)]
    accumulation = GLOBAL_BATCH // (micro * data_parallel)
    return [sorted(index for _ in range(accumulation) for rank in ranks for index in next(rank)) for _ in range(steps)]


@pytest.mark.parametrize("micro,data_parallel", [(4, 1), (1, 4), (2, 2)])
def test_a_resume_at_another_data_parallel_size_reads_the_samples_the_unbroken_run_reads_next(micro, data_parallel):
    """Saved at DP 2 (micro batch 2, 2 accumulation steps) after 3 steps; the same global batch at another
    DP size continues with exactly the samples, step by step, that the unbroken run read."""
    unbroken = samples_per_step(0, 2, 2, 6)
    saved = ClientState(iteration=3, consumed_train_samples=3 * GLOBAL_BATCH, consumed_valid_samples=0,
                        settings=make_args(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                                           train_batch_size=GLOBAL_BATCH, num_gpus=2).to_dict())
    args = make_args(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=GLOBAL_BATCH // (micro * data_parallel),
                     train_batch_size=GLOBAL_BATCH, num_gpus=data_parallel)
    position = data_position(saved, 3, PositionSettings.from_args(args))
    assert samples_per_step(position.consumed_train_samples, micro, data_parallel, 3) == unbroken[3:]


def test_fp16_to_bf16_says_the_loss_scaler_does_not_carry_over():
    change = ShapeChange(Shape(2, 1, 1, "fp16"), Shape(1, 1, 3, "bf16"))
    assert change.notes() == [
        "full resume at another shape: optimizer state resharded from DP 2 x TP 1, ZeRO-1 to DP 1 x TP 1, ZeRO-3, "
        "fp16 to bf16 (the fp32 master and Adam moments carry over as saved)",
        "fp16 loss scaler not carried over: bf16 trains without one"]
    assert ShapeChange(Shape(2, 1, 1, "bf16"), Shape(1, 1, 1, "bf16")).notes() == [
        "full resume at another shape: optimizer state resharded from DP 2 x TP 1, ZeRO-1 to DP 1 x TP 1, ZeRO-1"]
