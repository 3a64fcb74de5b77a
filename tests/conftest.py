"""Shared test fixtures: a one-process distributed world and a fp16-capable CPU accelerator."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


from megatron.launch.launcher import free_port  # noqa: E402  (re-exported: tests import it from here)
from tests.worker_report import REPORT_DIR_ENV, read_reports  # noqa: E402

# Elements in a ZeRO-3 engine's gradient-reduction bucket for tests (DeepSpeed's default is 5e8).
TEST_ZERO3_REDUCE_BUCKET = 1_000_000


def run_rank_worker(worker: Path, *worker_args: str, ranks: int = 2, timeout: int = 600) -> list[dict[str, Any]]:
    """The one way a test starts ranks of its own: `worker` on `ranks` CPU ranks started by
    torch.distributed.run (one thread each, LOCAL_SIZE set as DeepSpeed's launcher sets it, so DeepSpeed
    takes its one-node shared-memory path); the records its ranks reported (tests/worker_report.py). The
    test's own launcher variables are cleared so the worker's world is its own."""
    with tempfile.TemporaryDirectory(prefix="worker-report-") as report_dir:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_SIZE": str(ranks), REPORT_DIR_ENV: report_dir}
        for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(variable, None)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                   "--master_port", str(free_port()), str(worker), *worker_args]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, f"{ranks}-rank worker failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
        return read_reports(Path(report_dir))


@pytest.fixture(scope="session", autouse=True)
def small_zero3_reduce_buckets():
    """A ZeRO-3 engine reserves its whole reduce bucket up front: 1 GiB of untouched virtual memory in
    bf16 at DeepSpeed's default. The suite builds dozens of engines in one process, and once their
    reservations pass the machine's memory the kernel refuses fork() (DataLoader workers). Tests that
    leave `reduce_bucket_size` unset get a small one; a value a test sets is kept.
    """
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args, config=None, **kwargs):
        zero = config.get("zero_optimization") if isinstance(config, dict) else None
        if zero and zero.get("stage") == 3 and "reduce_bucket_size" not in zero:
            config = copy.deepcopy(config)
            config["zero_optimization"]["reduce_bucket_size"] = TEST_ZERO3_REDUCE_BUCKET
        return original(*args, config=config, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(deepspeed, "initialize", initialize)
    yield
    patch.undo()


@pytest.fixture(scope="session")
def single_rank_world():
    """torch.distributed (gloo) with world size 1 plus megatron-core's process groups.

    Real DeepSpeed engines need an initialised process group; one per test session suffices.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.runtime.initialize import init_deepspeed_distributed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        init_deepspeed_distributed(dist_backend="gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield
    # Process groups live until the interpreter exits; destroying them mid-session breaks
    # later tests that share this fixture.


def declare_cpu_fp16_capable(set_attribute=setattr) -> None:
    """DeepSpeed's CPU accelerator refuses fp16 although torch runs half precision on CPU.

    Tests only: declare it fp16-capable, and let fp16 gradients through its reduction (up to 0.16.0
    at least, ``supported_dtypes`` leaves fp16 out even when ``is_fp16_supported`` says yes).
    ``set_attribute`` is ``monkeypatch.setattr`` in a test, plain ``setattr`` in a worker process.
    """
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    set_attribute(accelerator, "is_fp16_supported", lambda: True)
    supported = accelerator.supported_dtypes()
    if torch.float16 not in supported:
        set_attribute(accelerator, "supported_dtypes", lambda: [*supported, torch.float16])


@pytest.fixture
def fp16_capable_cpu(monkeypatch):
    declare_cpu_fp16_capable(monkeypatch.setattr)
    yield
