"""ZeRO-3 builds the model partitioned (deepspeed.zero.Init): no rank holds it whole, and the weights are the seed's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("zero3_construction_worker.py")


def test_partitioned_build_holds_only_partitions_and_draws_the_seeds_weights_at_tp1_and_tp2():
    """2 ranks: fp32 and bf16, tied/learned-position and Llama/GQA models, tensor-parallel sizes 1 and 2;
    every parameter is a partition from the start, gathered it equals a whole build's, and a ZeRO-3
    engine on it gives the whole model's loss."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), str(WORKER)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"2-rank worker failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert "zero3 construction: ok" in result.stdout
    for family in ("tied-learned", "llama"):
        assert f"{family} tp1 bf16: partitions hold" in result.stdout
        assert f"{family} engine: loss" in result.stdout
