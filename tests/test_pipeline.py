"""Pipeline parallelism (pipe_parallel_size > 1) on DeepSpeed's PipelineModule and pipe engine, 2 CPU ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("pipeline_worker.py")


def run_worker(check: str, work_dir: Path, ranks: int = 2) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", str(free_port()), str(WORKER), check, str(work_dir)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{ranks}-rank worker failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert f"{check}: ok" in result.stdout
    return result.stdout


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
