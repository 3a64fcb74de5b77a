"""Two CPU ranks: per-rank RNG states and per-rank optimizer shards survive save -> plan -> load."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_rank_worker
from tests.worker_report import reported

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("orchestration_worker.py")


@pytest.mark.slow
def test_two_rank_resume_restores_each_ranks_rng_and_shards(tmp_path):
    records = run_rank_worker(WORKER, str(tmp_path / "checkpoints"))
    assert {record["rank"] for record in reported(records, case="resumed step", bit_identical=True)} == {0, 1}
    (tag,) = reported(records, case="saved tag")
    assert tag["optimizer_dp_ranks"] == [0, 1] and tag["data_parallel"] == 2
    assert tag["rng_states"] == 2
    assert "resharded from DP 2 x TP 1, ZeRO-2 to DP 1 x TP 1, ZeRO-2" in tag["one_rank_plan"]
    assert tag["finetune_module_only"]
