"""Module-only loads on 2 CPU ranks (bf16 ZeRO-2 and ZeRO-3), then the DP=2 checkpoints into DP=1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.checkpointing.loading.module_load import load_module_only
from megatron.checkpointing.ondisk.module_weights import read_module_weights
from tests.ckpt_engines import (
    batch,
    bits_equal,
    build_engine,
    ds_config,
    master_weights,
    set_lr,
    train_step,
    training_weights,
)
from tests.conftest import run_rank_worker
from tests.worker_report import reported

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("ckpt_engine_worker.py")


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp("two_ranks")
    records = run_rank_worker(WORKER, str(work_dir))
    for name in ("bf16-zero2", "bf16-zero3", "bf16-zero3-partitioned"):
        assert reported(records, case=name, ok=True), records
    return work_dir


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.parametrize(
    "saved,tag_parent,stage",
    [
        ("bf16-zero2", "bf16-zero2", 2),
        ("bf16-zero3", "bf16-zero3", 3),
        ("bf16-zero3", "bf16-zero3", 1),
        ("bf16-zero3-partitioned", "bf16-zero3-partitioned-shards", 3),
    ],
    ids=["zero2-to-zero2", "zero3-to-zero3", "zero3-to-zero1", "zero3-shards-to-zero3"],
)
@pytest.mark.slow
def test_dp2_checkpoint_loads_into_dp1(two_rank_checkpoints, saved, tag_parent, stage):
    expected = torch.load(two_rank_checkpoints / f"{saved}-expected.pt", weights_only=True)
    tag_dir = two_rank_checkpoints / tag_parent / "global_step1"
    assert not list(tag_dir.glob("*optim_states.pt")) or tag_parent.endswith("-shards")
    engine = build_engine(ds_config("bf16", stage), seed=4)
    load_module_only(engine, read_module_weights(tag_dir))
    set_lr(engine, 0.0)
    train_step(engine, batch(0))
    weights, masters = training_weights(engine), master_weights(engine)
    for name, value in expected.items():
        assert bits_equal(weights[name], value.bfloat16()), name
        assert bits_equal(masters[name], value), name
