"""Sequence parallelism on 2 CPU ranks over gloo: TP 2 with sequence_parallel takes the steps of TP 2 without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_rank_worker
from tests.worker_report import reported

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("sequence_parallel_worker.py")


@pytest.mark.slow
def test_sequence_parallel_takes_the_steps_of_tensor_parallelism_without_it(tmp_path):
    """Three Adam steps of LayerNorm and RMSNorm families (hidden dropout, recomputation, Qwen3's query/key norms,
    LoRA, experts with a shared expert, DPO, ZeRO-3): the same losses and weights (fp32, 1e-5). The norms' weights see only
    their rank's part of the sequence, so without the all-reduce of their gradients the steps differ."""
    records = run_rank_worker(WORKER, "steps", str(tmp_path), ranks=2)
    assert reported(records, check="steps", ok=True), records
    for case in ("neox dropout", "tied-learned recompute", "qwen3-yarn", "llama lora", "llama experts", "llama dpo",
                 "llama zero3"):
        assert reported(records, case=case), records
