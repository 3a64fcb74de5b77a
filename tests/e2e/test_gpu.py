"""The CUDA path: what only a GPU runs (NCCL, FusedAdam, fp16 with the GPU's own support, flash attention
through SDPA, the accelerator's RNG state in checkpoints). Run by tools/gpu_check.sh; skipped without a GPU.
"""

from __future__ import annotations

import re

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from tests.deepy_runs import run_deepy, tensorboard_scalars, train_lines, write_overrides

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(get_accelerator().device_name() == "cpu",
                                 reason="no GPU: DeepSpeed's accelerator is the CPU")]


@pytest.mark.e2e
def test_fp16_run_with_dynamic_loss_scaling_skips_overflows_and_trains(tmp_path):
    """fp16 as the GPU supports it (no test-only declaration): 2^32 overflows at once, the scale comes down."""
    overrides = write_overrides(tmp_path, precision="fp16", fp16={"enabled": True, "loss_scale": 0,
                                                                 "initial_scale_power": 32},
                                train_iters=40, lr_decay_iters=40, eval_interval=1000, checkpoint_factor=40,
                                save=str(tmp_path / "ckpt"), tensorboard_dir=str(tmp_path / "tb"))
    result = run_deepy(["configs/tiny.yml", overrides])
    lines = train_lines(result.stdout)
    skipped = tensorboard_scalars(tmp_path / "tb")["train/skipped_steps"]
    scales = [float(scale) for scale in re.findall(r"loss scale ([\d.e+]+)", result.stdout)]
    assert skipped[max(skipped)] > 0 and scales[-1] < 2.0**32
    assert lines[-1].loss < lines[0].loss - 1.0
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step40"


def test_accelerator_rng_state_round_trips_through_the_checkpoint_states():
    from megatron.checkpointing.ondisk.rng import collect_rng_states, restore_rng_states

    device = get_accelerator().current_device_name()
    states = collect_rng_states()
    assert "accelerator" in states
    expected = torch.rand(4, device=device)
    restore_rng_states(states)
    assert torch.equal(torch.rand(4, device=device), expected)


def test_attention_runs_a_flash_or_memory_efficient_sdpa_kernel_in_bf16():
    from megatron.model import build_model
    from tests.unit.test_model import NEOX, SEQ, VOCAB, tiny_args

    device = get_accelerator().current_device_name()
    model = build_model(tiny_args(NEOX).architecture(), 0).to(device=device, dtype=torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (2, SEQ), device=device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        model(tokens).float().sum().backward()
    kernels = " ".join(event.key for event in profile.key_averages()).lower()
    assert "flash" in kernels or "fmha" in kernels or "efficient_attention" in kernels, kernels[:2000]


@pytest.mark.usefixtures("single_rank_world")
def test_adam_on_the_gpu_is_deepspeeds_fused_adam():
    from tests.ckpt_engines import build_engine, ds_config

    optimizer = build_engine(ds_config("bf16", 1)).optimizer
    names = []
    while optimizer is not None:
        names.append(type(optimizer).__name__)
        optimizer = getattr(optimizer, "optimizer", None)
    assert "FusedAdam" in names, names
