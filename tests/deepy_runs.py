"""Helpers for end-to-end tests: run deepy.py as a user would and read what it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent

# Small and quick on 2 CPU cores, yet the same model family and data as configs/tiny.yml.
QUICK_SETTINGS = {"log_interval": 1, "eval_iters": 2, "train_micro_batch_size_per_gpu": 4}

# What DeepSpeed, torch and megatron-core print that reports nothing wrong; no command shows it unless asked
# (megatron/foreign_notices.py). Spelled out here as a user sees it, not taken from the code that hides it.
FOREIGN_NOTICE = re.compile(r"Setting (ds_)?accelerator to|No CUDA runtime is found|Transformer Engine and Apex are "
                            r"not installed|all_gather_into_tensor` is deprecated|DeepSpeed \S+ built successfully")


def foreign_notices(output: str) -> list[str]:
    return [line for line in output.splitlines() if FOREIGN_NOTICE.search(line)]


TRAIN_LINE = re.compile(r"iteration\s+(\d+)/(\d+) \| loss ([\d.]+) \| lr ([\d.e+-]+)")


@dataclass
class TrainLine:
    iteration: int
    loss: float
    lr: float


def write_overrides(directory: Path, name: str = "overrides.yml", **settings) -> Path:
    """A config file of `settings` over the quick defaults. No master_port unless a test sets one: deepy.py
    picks a free port at launch, whereas a port picked here could be taken by another test's connections
    before the run binds it."""
    path = Path(directory) / name
    path.write_text(yaml.safe_dump({**QUICK_SETTINGS, **settings}, sort_keys=False))
    return path


def run_deepy(configs: list, *extra_args: str, expect_success: bool = True, timeout: int = 600,
              script: str = "train.py"):
    command = [sys.executable, "deepy.py", script, *map(str, configs), *extra_args]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if expect_success and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}\n"
                             f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}")
    return result


def train_lines(output: str) -> list[TrainLine]:
    lines = [TrainLine(int(m[1]), float(m[3]), float(m[4])) for m in TRAIN_LINE.finditer(output)]
    assert lines, f"no training lines in the output:\n{output[-4000:]}"
    return lines


def tensorboard_scalars(tensorboard_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar a run wrote to `tensorboard_dir`: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def checkpoint_files(directory: Path) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir())
