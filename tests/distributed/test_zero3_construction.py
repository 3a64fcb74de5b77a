"""ZeRO-3 builds the model partitioned (deepspeed.zero.Init): no rank holds it whole, and the weights are the seed's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_rank_worker
from tests.worker_report import reported

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("zero3_construction_worker.py")


@pytest.mark.slow
def test_partitioned_build_holds_only_partitions_and_draws_the_seeds_weights_at_tp1_and_tp2():
    """2 ranks: fp32 and bf16, tied/learned-position and Llama/GQA models, tensor-parallel sizes 1 and 2;
    every parameter is a partition from the start, gathered it equals a whole build's, and a ZeRO-3
    engine on it gives the whole model's loss."""
    records = run_rank_worker(WORKER)
    assert len(reported(records, check="zero3 construction", ok=True)) == 2, records  # both ranks
    for family in ("tied-learned", "llama"):
        (held,) = reported(records, case=f"{family} tp1 bf16")
        assert 0 < held["partition_elements"] < held["whole_elements"], held  # rank 0 holds a part, never the whole
        assert reported(records, case=f"{family} engine"), records
