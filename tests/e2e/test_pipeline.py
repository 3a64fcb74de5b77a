"""End to end with 2 pipeline stages on 2 CPU ranks (pipe_parallel_size 2, ZeRO-1), run with deepy.py as a
user runs it: GPT-NeoX's layer files, an exact resume, and module-only loads between 2 stages and one module
(2 tensor-parallel ranks), and from the layer files convert_hf_to_neox.py writes; a mixture of experts in 2 stages
against the same run without a pipeline."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from megatron.checkpointing.ondisk.inventory import inventory_tag
from megatron.checkpointing.ondisk.manifest import read_manifest
from megatron.checkpointing.ondisk.module_weights import read_full_module_weights, read_module_weights
from megatron.hf.config import architecture_of
from megatron.hf.convert import convert_hf_to_neox, convert_neox_to_hf
from tests.deepy_runs import checkpoint_files, run_deepy, tensorboard_scalars, train_lines, write_overrides
from tests.unit.test_inspect_checkpoint import inspect

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

PIPE = dict(num_gpus=2, pipe_parallel_size=2, gradient_accumulation_steps=2, eval_interval=2)
# A learning rate far below the last bit of any weight: a run that loads weights, takes one step and
# saves them again saves exactly what it loaded.
FROZEN = dict(optimizer={"type": "AdamW", "params": {"lr": 1e-30}}, min_lr=0.0, weight_decay=0.0, train_iters=1,
              checkpoint_factor=1, finetune=True, gradient_accumulation_steps=2)
# configs/tiny.yml's 4 layers at GPT-NeoX's positions 2-5; type:transformer|mlp gives each stage two
LAYER_FILES = [f"layer_{i:02d}-model_00-model_states.pt" for i in (0, 2, 3, 4, 5, 7, 8)]


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("pipe2")
    save = work / "ckpt"
    overrides = write_overrides(work, save=str(save), train_iters=4, checkpoint_factor=2,
                                tensorboard_dir=str(work / "tb"), **PIPE)
    result = run_deepy(["configs/tiny.yml", overrides])
    assert "x 2 pipeline stages" in result.stdout
    return work, save, train_lines(result.stdout)


def test_a_pipelined_run_saves_gpt_neox_layer_files_and_resumes_exactly(pipelined_run):
    work, save, lines = pipelined_run
    assert lines[-1].iteration == 4 and lines[-1].loss < lines[0].loss
    scalars = tensorboard_scalars(work / "tb")  # written by the first stage's rank 0
    assert set(scalars["train/loss"]) == set(scalars["train/grad_norm"]) == {1, 2, 3, 4}
    assert {step for tag, steps in scalars.items() if tag.startswith("valid/") for step in steps} == {2, 4}
    tag = save / "global_step4"
    files = checkpoint_files(tag)
    assert [f for f in files if f.startswith("layer_")] == LAYER_FILES
    # DeepSpeed's pipe engine: one model-states file and one ZeRO-1 shard per stage
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
            "zero_pp_rank_0_mp_rank_01_optim_states.pt"} <= set(files)
    assert set(LAYER_FILES) <= set(read_manifest(tag))
    config = yaml.safe_load((tag / "configs" / "neox_config.yml").read_text())
    assert config["pipe_parallel_size"] == 2 and config["pipe_partition_method"] == "type:transformer|mlp"
    report = inspect(save)
    assert (report["format"], report["tensor_parallel_size"], report["pipeline_stages"]) == ("pipeline", 1, 2)
    assert report["model"] == "gpt_neox, no variants", json.dumps(report)[:2000]
    assert report["load_modes"]["finetune"]["possible"]

    resumed = write_overrides(work, name="resume.yml", save=str(work / "resumed"), load=str(save), iteration=2,
                              train_iters=4, checkpoint_factor=2, **PIPE)
    after = train_lines(run_deepy(["configs/tiny.yml", resumed]).stdout)
    assert [(line.iteration, line.loss) for line in after] == [(line.iteration, line.loss) for line in lines[2:]]


def test_weights_move_between_pipeline_and_tensor_parallel_sizes_and_through_hf_bit_for_bit(pipelined_run, tmp_path):
    """Module-only loads (with the master refresh and its verification) 2 stages -> 2 tensor-parallel ranks without
    a pipeline (both sizes change at once) -> 2 stages, and our layer files -> Hugging Face -> GPT-NeoX layer files
    written by convert_hf_to_neox.py --pipe-parallel-size 2 -> 2 stages: every saved tensor is the one loaded, and
    the frozen runs, fed the same batch (one data-parallel rank each), report the same loss."""
    work, save, _ = pipelined_run
    one = write_overrides(work, name="to-tp2.yml", load=str(save), save=str(work / "one"), num_gpus=2,
                          model_parallel_size=2, **FROZEN)
    one_lines = train_lines(run_deepy(["configs/tiny.yml", one]).stdout)
    two = write_overrides(work, name="to-pp2.yml", load=str(work / "one"), save=str(work / "two"), num_gpus=2,
                          pipe_parallel_size=2, **FROZEN)
    two_lines = train_lines(run_deepy(["configs/tiny.yml", two]).stdout)

    convert_neox_to_hf(save, tmp_path / "hf", dtype="fp32", save_tokenizer=False)
    convert_hf_to_neox(tmp_path / "hf", tmp_path / "from-hf", pipe_parallel_size=2)
    converted_files = checkpoint_files(tmp_path / "from-hf" / "global_step0")
    assert [f for f in converted_files if f.startswith("layer_")] == LAYER_FILES
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(converted_files)
    three = write_overrides(work, name="from-hf.yml", load=str(tmp_path / "from-hf"), save=str(work / "three"),
                            num_gpus=2, pipe_parallel_size=2, **FROZEN)
    three_lines = train_lines(run_deepy(["configs/tiny.yml", three]).stdout)

    assert two_lines[0].loss == three_lines[0].loss
    # 2 tensor-parallel ranks sum their partial products in another order than one rank: the last bits may differ
    assert one_lines[0].loss == pytest.approx(two_lines[0].loss, rel=1e-6)
    original = read_module_weights(save / "global_step4")
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(checkpoint_files(work / "one" / "global_step1"))
    assert [f for f in checkpoint_files(work / "two" / "global_step1") if f.startswith("layer_")] == LAYER_FILES
    arch = architecture_of({**inventory_tag(save, "global_step4").metadata.saved_args, "model_parallel_size": 1})
    for moved in (read_full_module_weights(work / "one" / "global_step1", 2, arch),
                  read_module_weights(work / "two" / "global_step1"), read_module_weights(tmp_path / "from-hf" / "global_step0"),
                  read_module_weights(work / "three" / "global_step1")):
        assert moved.keys() == original.keys()
        assert all(torch.equal(moved[name], original[name]) for name in original)


def test_two_stages_stop_together_at_the_first_nonfinite_step_and_keep_the_last_good_checkpoint(tmp_path):
    """The pipe engine's loss and gradient norm (every stage's) reach the divergence stop on both stages."""
    save = tmp_path / "ckpt"
    overrides = write_overrides(
        tmp_path, save=str(save), train_iters=12, checkpoint_factor=1, keep_last_n_checkpoints=None,
        warmup=0, optimizer={"type": "AdamW", "params": {"lr": 1.0e4, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        **{**PIPE, "eval_interval": 100})
    result = run_deepy(["configs/tiny.yml", overrides], expect_success=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    diverged = int(re.search(r"iteration (\d+) \(fp32\): loss \S+, gradient norm \S+.* The run diverged", output)[1])
    saved = sorted(int(p.name.removeprefix("global_step")) for p in save.glob("global_step*"))
    assert saved == list(range(1, diverged)), f"saved {saved}, diverged at {diverged}"
    assert (save / "latest").read_text().strip() == f"global_step{diverged - 1}"
    assert "Traceback" not in output, output[-4000:]


# GPT-NeoX's sinkhorn router, 4 experts in each of configs/tiny.yml's 4 layers (2 on each stage), with
# transformers' load-balancing loss in the loss: its gradient crosses the stages with the router statistics
EXPERTS = dict(moe_num_experts=4, moe_load_balancing_loss=True, moe_load_balancing_loss_coef=0.01)
EXPERT_LINE = re.compile(r"iteration\s+(\d+)/\d+ \| loss ([\d.]+) \| lm_loss ([\d.]+) \| load_balancing_loss ([\d.]+) \| "
                         r"max_expert_load ([\d.]+) \|")


def expert_lines(output: str) -> list[tuple]:
    return [(int(m[1]), *map(float, m.groups()[1:])) for m in EXPERT_LINE.finditer(output)]


def expert_loads(scalars: dict, step: int) -> list[list[float]]:
    """Every layer's expert loads at ``step``, from TensorBoard (configs/tiny.yml's 4 layers, 4 experts)."""
    return [[scalars[f"train/expert_load/layer_{layer}/expert_{expert}"][step] for expert in range(4)]
            for layer in range(4)]


def test_a_pipelined_mixture_of_experts_trains_as_one_module_reports_every_stage_s_experts_and_resumes_exactly(
        tmp_path):
    """2 stages, experts in every layer: the log line and TensorBoard (written by the first stage's rank) carry
    every layer's expert load, the last stage's layers' too, and the load-balancing loss in the loss; the
    validation line its metrics. The same run without a pipeline takes the same 4 steps (lines and expert loads;
    measured: equal to the line's digits), and a resume from step 2 the same steps 3 and 4; so do 2 stages of 2
    tensor-parallel ranks with the experts split over them, in their first 2 steps."""
    save = tmp_path / "ckpt"
    overrides = write_overrides(tmp_path, save=str(save), train_iters=4, checkpoint_factor=2,
                                tensorboard_dir=str(tmp_path / "tb"), **PIPE, **EXPERTS)
    result = run_deepy(["configs/tiny.yml", overrides])
    assert "x 2 pipeline stages" in result.stdout
    lines = expert_lines(result.stdout)
    assert [line[0] for line in lines] == [1, 2, 3, 4], result.stdout[-3000:]
    scalars = tensorboard_scalars(tmp_path / "tb")
    for step, loss, lm_loss, balance, max_load in lines:
        assert loss == pytest.approx(lm_loss + 0.01 * balance, abs=2e-4)
        loads = expert_loads(scalars, step)
        for layer_loads in loads:
            assert sum(layer_loads) == pytest.approx(1.0, abs=1e-6), loads
        assert max_load == pytest.approx(max(max(layer_loads) for layer_loads in loads), abs=1e-4)
        assert scalars["train/load_balancing_loss"][step] == pytest.approx(balance, abs=1e-4)
    assert {"valid/lm_loss", "valid/load_balancing_loss", "valid/expert_load/layer_3/expert_0"} <= set(scalars)
    assert re.search(r"validation at iteration 2: loss [\d.]+ \| lm_loss [\d.]+ \| load_balancing_loss", result.stdout)

    flat = write_overrides(tmp_path, name="flat.yml", train_iters=4, tensorboard_dir=str(tmp_path / "tb-flat"),
                           **{**PIPE, "num_gpus": 1, "pipe_parallel_size": 1}, **EXPERTS)
    flat_lines = expert_lines(run_deepy(["configs/tiny.yml", flat]).stdout)
    assert [line[0] for line in flat_lines] == [1, 2, 3, 4]
    for line, flat_line in zip(lines, flat_lines, strict=True):
        assert line == pytest.approx(flat_line, abs=2e-4)
    flat_scalars = tensorboard_scalars(tmp_path / "tb-flat")
    for step in (1, 2, 3, 4):
        assert expert_loads(scalars, step) == expert_loads(flat_scalars, step)  # tokens counted: exact

    resumed = write_overrides(tmp_path, name="resume.yml", save=str(tmp_path / "resumed"), load=str(save),
                              iteration=2, train_iters=4, checkpoint_factor=2, **PIPE, **EXPERTS)
    assert expert_lines(run_deepy(["configs/tiny.yml", resumed]).stdout) == lines[2:]

    # GPT-NeoX's 125M-dmoe shape: 2 stages of 2 tensor-parallel ranks, each rank holding 2 of every layer's 4
    # experts; the statistics cross the stages whole (DeepSpeed's partitioned sends would refuse them)
    split = write_overrides(tmp_path, name="split.yml", train_iters=2,
                            **{**PIPE, "num_gpus": 4, "model_parallel_size": 2}, **EXPERTS)
    split_lines = expert_lines(run_deepy(["configs/tiny.yml", split]).stdout)
    assert [line[0] for line in split_lines] == [1, 2]
    for line, flat_line in zip(split_lines, flat_lines, strict=False):
        assert line == pytest.approx(flat_line, abs=2e-4)
