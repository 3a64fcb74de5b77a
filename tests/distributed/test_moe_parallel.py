"""Experts split over 2 CPU tensor-parallel ranks (gloo), as GPT-NeoX splits them: see moe_parallel_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_rank_worker
from tests.worker_report import reported

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("moe_parallel_worker.py")


@pytest.mark.slow
def test_experts_split_over_two_ranks_train_as_transformers_and_move_between_split_sizes(tmp_path):
    """One start: Mixtral, Qwen3-MoE, Qwen2-MoE and OLMoE folders at TP 2 take transformers' first step (loss, load-balancing loss,
    every gradient); a rank whose experts get no token steps as size 1 does; a tag saved at TP 2 resumes in full at
    TP 1 with the unbroken run's losses and back, and module-only loads across the split are bit-exact."""
    records = run_rank_worker(WORKER, "experts", str(tmp_path))
    assert reported(records, check="experts", ok=True), records
    for case in ("mixtral folder at tp2", "qwen3_moe folder at tp2", "qwen2_moe folder at tp2",
                 "olmoe folder at tp2", "a rank without tokens",
                 "resume tp2 -> tp1 -> tp2", "module-only across the split"):
        assert reported(records, case=case), records
