"""A full resume at another shape (megatron/checkpointing/reshard.py), on 2 CPU ranks: see tests/reshard_worker.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("reshard_worker.py")


def test_resharded_resume_restores_every_master_and_moment_bit_exact(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_SIZE": "2"}
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), str(WORKER), str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"2-rank worker failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    for case in ("neox fp32", "neox bf16", "llama fp32", "llama bf16", "bf16 to fp32"):
        assert f"{case}: ok" in result.stdout
    assert "unrestored moment: caught" in result.stdout
