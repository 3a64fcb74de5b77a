"""End to end: GPT-NeoX's checkpoint, logging and profiling settings as a GPT-NeoX user writes them."""

from __future__ import annotations

import math
import pickle
import socket

import pytest
import torch

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from tests.deepy_runs import run_deepy, tensorboard_scalars, train_lines, write_overrides

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_extra_saves_norms_profiler_memory_snapshot_and_log_dir(tmp_path):
    save, tensorboard, snapshots, logs = (tmp_path / name for name in ("ckpt", "tb", "mem", "logs"))
    overrides = write_overrides(
        tmp_path, save=str(save), train_iters=4, eval_interval=100, checkpoint_factor=None,
        extra_save_iters=[0, 2], keep_last_n_checkpoints=None, tensorboard_dir=str(tensorboard), log_grad_norm=True, log_param_norm=True,
        profile=True, profile_step_start=1, profile_step_stop=2, memory_profiling=True,
        memory_profiling_path=str(snapshots), log_dir=str(logs),
    )
    result = run_deepy(["configs/tiny.yml", overrides])
    assert [line.iteration for line in train_lines(result.stdout)][-1] == 4

    # extra_save_iters: the untrained model (0), iteration 2, and the end of the run; nothing else
    assert sorted(p.name for p in save.glob("global_step*")) == ["global_step0", "global_step2", "global_step4"]

    # log_param_norm at step 3 is read before its optimizer step: the weights saved at iteration 2
    scalars = tensorboard_scalars(tensorboard)
    saved = read_module_weights(save / "global_step2")
    for name, weight in saved.items():
        assert scalars[f"parameter_norms/{name}"][3] == pytest.approx(weight.float().norm().item(), rel=1e-5)
    # log_grad_norm: the per-parameter norms make up the global norm DeepSpeed clips with
    gradient_tags = [tag for tag in scalars if tag.startswith("gradient_norms/")]
    assert len(gradient_tags) == len(saved)
    for step in (1, 4):
        total = math.sqrt(sum(scalars[tag][step] ** 2 for tag in gradient_tags))
        assert total == pytest.approx(scalars["train/grad_norm"][step], rel=1e-4)

    # profile: a torch.profiler trace in tensorboard_dir, where GPT-NeoX writes it
    traces = list(tensorboard.glob("*.pt.trace.json"))
    assert len(traces) == 1 and "train_step" not in traces[0].name and traces[0].stat().st_size > 0
    # memory_profiling: a snapshot GPT-NeoX's tools read (empty without CUDA)
    with open(snapshots / "mem_snapshot.pickle", "rb") as stream:
        assert "segments" in pickle.load(stream)
    # log_dir: every rank's stdout and stderr, also in <log_dir>/<host>_stdout.txt / _stderr.txt
    written = (logs / f"{socket.gethostname()}_stdout.txt").read_text()
    assert "iteration 4/4" in written
    assert (logs / f"{socket.gethostname()}_stderr.txt").exists()
    assert torch.load(save / "global_step0" / "mp_rank_00_model_states.pt", weights_only=False)["iteration"] == 0
