"""End to end: LoRA fine-tunes of a tiny checkpoint through deepy.py, as a user starts them."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing import read_module_weights
from tests.deepy_runs import TRAIN_LINE, run_deepy, train_lines, write_overrides

pytestmark = pytest.mark.e2e

LORA = {"lora_rank": 4, "lora_alpha": 8, "lora_target_modules": "all-linear", "eval_interval": 1000,
        "lr_decay_iters": 4}  # one schedule for the fine-tune and its resume


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny fp32 ZeRO-1 checkpoint without adapters, after 2 steps."""
    directory = tmp_path_factory.mktemp("base")
    save = directory / "ckpt"
    run_deepy(["configs/tiny.yml", write_overrides(directory, save=str(save), train_iters=2, checkpoint_factor=2,
                                                   eval_interval=1000)])
    return save


def test_a_lora_finetune_trains_the_adapters_alone_and_its_tag_resumes(base, tmp_path):
    out = tmp_path / "lora"
    result = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, load=str(base), save=str(out), finetune=True,
                                                            train_iters=3, checkpoint_factor=3, **LORA)])
    assert "LoRA adapters (A drawn from the seed, B zero" in result.stdout  # the load plan says they start fresh
    base_weights = read_module_weights(base / "global_step2")
    tuned = read_module_weights(out / "global_step3")
    adapters = {name for name in tuned if ".lora." in name}
    assert adapters and set(tuned) - adapters == set(base_weights)
    for name, value in base_weights.items():
        assert torch.equal(tuned[name], value), f"{name}: a frozen base weight changed"
    assert all(tuned[name].any() for name in adapters if name.endswith("lora_B")), "an adapter did not train"

    resumed = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, name="resume.yml", load=str(out),
                                                             save=str(out), train_iters=4, checkpoint_factor=4,
                                                             **LORA)])
    assert [line.iteration for line in train_lines(resumed.stdout)] == [4]


def test_a_full_resume_of_a_checkpoint_without_adapters_into_a_lora_run_is_refused(base, tmp_path):
    result = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, load=str(base), save=str(tmp_path / "out"),
                                                            train_iters=3, **LORA)], expect_success=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "was saved without LoRA adapters (lora_rank 0)" in output and "finetune: true" in output
    assert TRAIN_LINE.search(output) is None
