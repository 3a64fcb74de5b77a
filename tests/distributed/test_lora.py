"""LoRA on every layout, on 2 CPU ranks over gloo: the first step at tensor-parallel size 2 and under ZeRO-3 is
the step of size 1 / ZeRO-0 (which is PEFT's gradient: tests/unit/test_lora.py), and a ZeRO-3 tag holds the full
adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_rank_worker
from tests.worker_report import reported

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("lora_worker.py")


def run_worker(check: str, work_dir: Path) -> list[dict]:
    records = run_rank_worker(WORKER, check, str(work_dir))
    assert reported(records, check=check, ok=True), records
    return records


@pytest.mark.slow
def test_tp2_draws_the_adapters_of_tp1_and_its_first_step_moves_them_as_tp1(tmp_path):
    """Both families, grouped-query and multi-query (the key/value head on both ranks) attention: A whole and B
    split on column-parallel layers, A split and B whole on row-parallel ones; the base does not move. Each rank
    given the other's slices takes another step: the comparison sees a wrong split."""
    records = run_worker("tp2", tmp_path)
    for family in ("llama", "llama-mqa", "neox"):
        (case,) = reported(records, case=f"{family} tp2")
        assert case["adapters"] > 0 and case["swapped_split_caught"] > 0, case


@pytest.mark.slow
def test_zero3_partitions_the_adapters_steps_as_zero0_and_saves_them_full(tmp_path):
    records = run_worker("zero3", tmp_path)
    (case,) = reported(records, case="zero3")
    assert case["partitioned"] > 0 and case["saved_adapter_bytes"] > 1000, case


@pytest.mark.slow
def test_a_tp2_lora_tag_loads_at_tp1_under_zero3_with_the_saved_adapters(tmp_path):
    records = run_worker("reshard", tmp_path)
    assert reported(records, case="tp2 -> tp1 zero3"), records


@pytest.mark.slow
def test_adapters_on_experts_split_over_tp2_step_as_tp1_and_load_back_at_tp1(tmp_path):
    """The experts' adapters (PEFT's target_parameters) split with their experts; see lora_worker.py."""
    records = run_worker("experts", tmp_path)
    (case,) = reported(records, case="experts tp2")
    assert case["expert_adapters"] == 8 and case["swapped_split_caught"] > 0, case
