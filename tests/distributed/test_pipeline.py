"""Pipeline parallelism (pipe_parallel_size > 1) on DeepSpeed's PipelineModule and pipe engine, 2 CPU ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_rank_worker

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("pipeline_worker.py")


def run_worker(check: str, work_dir: Path, ranks: int = 2) -> str:
    stdout = run_rank_worker(WORKER, check, str(work_dir), ranks=ranks)
    assert f"{check}: ok" in stdout
    return stdout


@pytest.mark.slow
def test_two_stages_draw_the_same_weights_and_give_the_same_loss_and_gradients_as_one_module(tmp_path):
    """GPT-NeoX/Pythia (untied, partial rotary, parallel residual), GPT-2 style (tied embedding across the first
    and last stage, learned positions) and Llama (RMSNorm, SwiGLU, grouped-query attention, recomputed
    activations): each stage's weights are build_model's bit for bit, and one train_batch of 2 micro batches
    gives build_model's loss (within 1e-6; measured: equal) and gradients (rtol 1e-5, atol 1e-7; measured:
    equal but for the tied embedding's, summed over both stages, 7.5e-9 off)."""
    stdout = run_worker("equivalence", tmp_path)
    for family in ("neox", "tied-learned", "llama"):
        assert f"rank 1 {family} at TP 1: loss" in stdout and f"rank 0 {family} at TP 1: loss" in stdout
    # GPT-NeoX's positions: type:transformer|mlp puts 2 of the 3 layers on the first stage
    assert "layer positions ['0', '2', '3']" in stdout and "layer positions ['4', '6', '7']" in stdout


@pytest.mark.slow
def test_two_stages_by_two_tensor_parallel_ranks_are_the_same_model_as_one_module(tmp_path):
    """4 ranks, DeepSpeed's pipe/data/model topology over megatron-core's groups (checked to place the ranks
    alike): the whole weights joined over each stage's tensor-parallel pair are build_model's bit for bit, the
    loss is within 1e-6 and the gradients within rtol 1e-5, atol 1e-7 (measured: 1.2e-7 at most)."""
    stdout = run_worker("tensor_parallel", tmp_path, ranks=4)
    for family in ("neox", "tied-learned", "llama"):
        assert all(f"rank {rank} {family} at TP 2: loss" in stdout for rank in range(4))
