"""A checkpoint saved with one DP size, ZeRO stage and precision fine-tunes under another.

    fp32 ZeRO-0 on 2 ranks -> bf16 ZeRO-3 on 1 rank
    bf16 ZeRO-2 on 1 rank  -> fp16 ZeRO-1 on 2 ranks

Each load goes save_checkpoint -> plan_load -> load_checkpoint, then one optimizer step at learning
rate 0: the training-dtype weights must equal the checkpoint's (cast) bit for bit and the fp32 master
weights the checkpoint's values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ckpt_engines import make_args
from tests.conftest import run_rank_worker
from tests.distributed.cross_config_worker import EXPECTED, finetune_and_check, save_trained
from tests.worker_report import reported

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("cross_config_worker.py")


def _on_two_ranks(phase: str, root: Path) -> None:
    records = run_rank_worker(WORKER, phase, str(root))
    assert len(reported(records, phase=phase, ok=True)) == 2, records


@pytest.mark.slow
def test_fp32_zero0_on_two_ranks_finetunes_in_bf16_zero3_on_one(single_rank_world, tmp_path):
    _on_two_ranks("save fp32 zero0", tmp_path)
    expected = torch.load(tmp_path / EXPECTED)
    finetune_and_check(make_args(stage=3, precision="bf16", load=str(tmp_path), finetune=True), 1, expected)


@pytest.mark.slow
def test_bf16_zero2_on_one_rank_finetunes_in_fp16_zero1_on_two(single_rank_world, tmp_path):
    expected = save_trained(make_args(stage=2, precision="bf16", save=str(tmp_path)))
    torch.save(expected, tmp_path / EXPECTED)
    _on_two_ranks("finetune fp16 zero1", tmp_path)
