"""Pipeline parallelism (pipe_parallel_size > 1) on DeepSpeed's PipelineModule and pipe engine, 2 CPU ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_rank_worker
from tests.worker_report import reported

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("pipeline_worker.py")


def run_worker(check: str, work_dir: Path, ranks: int = 2) -> list[dict]:
    records = run_rank_worker(WORKER, check, str(work_dir), ranks=ranks)
    assert reported(records, check=check, ok=True), records
    return records


@pytest.mark.slow
def test_two_stages_draw_the_same_weights_and_give_the_same_loss_and_gradients_as_one_module(tmp_path):
    """GPT-NeoX/Pythia (untied, partial rotary, parallel residual), GPT-2 style (tied embedding across the first
    and last stage, learned positions) and Llama (RMSNorm, SwiGLU, grouped-query attention, recomputed
    activations): each stage's weights are build_model's bit for bit, and one train_batch of 2 micro batches
    gives build_model's loss (within 1e-6; measured: equal) and gradients (rtol 1e-5, atol 1e-7; measured:
    equal but for the tied embedding's, summed over both stages, 7.5e-9 off)."""
    records = run_worker("equivalence", tmp_path)
    for family in ("neox", "tied-learned", "llama"):
        assert reported(records, rank=1, case=f"{family} at TP 1") and reported(records, rank=0, case=f"{family} at TP 1")
    # GPT-NeoX's positions: type:transformer|mlp puts 2 of the 3 layers on the first stage
    positions = {tuple(record["layer_positions"]) for record in records if "layer_positions" in record}
    assert {("0", "2", "3"), ("4", "6", "7")} <= positions, positions


@pytest.mark.slow
def test_two_stages_by_two_tensor_parallel_ranks_are_the_same_model_as_one_module(tmp_path):
    """4 ranks, DeepSpeed's pipe/data/model topology over megatron-core's groups (checked to place the ranks
    alike): the whole weights joined over each stage's tensor-parallel pair are build_model's bit for bit, the
    loss is within 1e-6 and the gradients within rtol 1e-5, atol 1e-7 (measured: 1.2e-7 at most)."""
    records = run_worker("tensor_parallel", tmp_path, ranks=4)
    for family in ("neox", "tied-learned", "llama"):
        assert all(reported(records, rank=rank, case=f"{family} at TP 2") for rank in range(4)), records


@pytest.mark.slow
def test_two_stages_with_experts_train_the_objective_of_one_module(tmp_path):
    """Experts in layers 0 and 2 of 4 (one expert layer per stage), GPT-NeoX's sinkhorn router and the top-k router
    with the load-balancing loss in the loss (coefficient 0.5, recomputed activations): one step through DeepSpeed's
    pipe engine (megatron.training.pipe_engine.train_step) gives one module's loss and metrics, lm_loss, load_balancing_loss and
    every layer's expert load, whichever stage holds the layer (measured: equal), and its gradients (rtol 1e-5,
    atol 1e-7)."""
    records = run_worker("experts", tmp_path)
    for case in ("experts, sinkhorn", "experts, topk, balanced"):
        assert reported(records, rank=0, case=case) and reported(records, rank=1, case=case), records
    balanced = next(record for record in records if record.get("case") == "experts, topk, balanced")
    assert {"lm_loss", "load_balancing_loss", "expert_load/layer_0/expert_0", "expert_load/layer_2/expert_3"} <= set(
        balanced["metrics"])
