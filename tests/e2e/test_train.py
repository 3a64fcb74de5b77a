"""End to end: ``python deepy.py train.py configs/tiny.yml <overrides>`` as a user runs it."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.contract.architecture import architecture_mismatches, fields_of_settings
from megatron.neox_arguments import NeoXArgs, padded_vocab_size
from megatron.tokenizer import build_tokenizer
from megatron.training.learning_rates import learning_rate_at
from tests.ckpt_engines import stored_client_state
from tests.deepy_runs import (
    checkpoint_files,
    foreign_notices,
    run_deepy,
    tensorboard_scalars,
    train_lines,
    write_overrides,
)
from tests.unit.test_neox_config import keys_gpt_neox_refuses

pytestmark = pytest.mark.e2e


def test_single_rank_run_trains_evaluates_and_saves(tmp_path):
    save = tmp_path / "ckpt"
    overrides = write_overrides(tmp_path, save=str(save), train_iters=40, checkpoint_factor=20, eval_interval=20)
    result = run_deepy(["configs/tiny.yml", overrides])
    assert foreign_notices(result.stdout + result.stderr) == []  # also in the rank's output
    lines = train_lines(result.stdout)
    assert [line.iteration for line in lines][-1] == 40
    first, last = lines[0].loss, lines[-1].loss
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert re.search(r"validation at iteration 20: loss [\d.]+ \| perplexity [\d.]+", result.stdout)
    assert re.search(r"test: loss [\d.]+ \| perplexity", result.stdout)
    assert (save / "latest").read_text().strip() == "global_step40"
    files = checkpoint_files(save / "global_step40")
    assert "mp_rank_00_model_states.pt" in files
    assert any(f.endswith("zero_pp_rank_0_mp_rank_00_optim_states.pt") for f in files)
    assert {"tiny.yml", overrides.name} <= set(checkpoint_files(save / "global_step40" / "configs"))
    config = assert_gpt_neox_config_describes_the_files(save / "global_step40")
    assert config["activation"] == "gelu"
    linear1 = read_module_weights(save / "global_step40")["sequential.2.mlp.linear1.weight"]
    assert linear1.shape == (config["intermediate_size"], config["hidden_size"])
    assert not (config.get("fp16") or {}).get("enabled") and not (config.get("bf16") or {}).get("enabled")


# What GPT-NeoX's tools/ckpts/convert_neox_to_hf.py reads from the one config file it is given.
NEOX_CONVERTER_KEYS = ("tokenizer_type", "vocab_file", "make_vocab_size_divisible_by", "model_parallel_size",
                       "pipe_parallel_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads",
                       "max_position_embeddings", "init_method_std", "no_weight_tying", "rotary_pct",
                       "rotary_emb_base", "gpt_j_residual", "layernorm_epsilon", "rms_norm_epsilon",
                       "intermediate_size", "activation", "use_bias_in_attn_linear")


def assert_gpt_neox_config_describes_the_files(tag_dir: Path) -> dict:
    """<tag>/configs/neox_config.yml holds every key the converter reads, with values that match the files:
    the single-file layout (pipe_parallel_size 0), one mp_rank file per model_parallel_size, the tokenizer
    the embedding was padded for, the layer count and widths of the stored weights."""
    config = yaml.safe_load((tag_dir / "configs" / "neox_config.yml").read_text())
    assert set(NEOX_CONVERTER_KEYS) <= set(config)
    assert keys_gpt_neox_refuses(tag_dir / "configs" / "neox_config.yml") == set()  # GPT-NeoX's NeoXArgs loads it
    mp_files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    assert config["model_parallel_size"] == len(mp_files) == 1
    assert config["pipe_parallel_size"] == 0 and not list(tag_dir.glob("layer_*-model_*-model_states.pt"))
    module = torch.load(mp_files[0], map_location="cpu", weights_only=True)["module"]  # as the converter loads it
    layers = config["num_layers"]
    positions = {int(name.split(".")[1]) for name in module}
    assert positions == {0, *range(2, layers + 2), layers + 3} | ({layers + 4} if config["no_weight_tying"] else set())
    vocab_file = Path(config["vocab_file"])
    assert vocab_file.is_absolute() and vocab_file.is_file()
    tokenizer = build_tokenizer(SimpleNamespace(merge_file=None, **config))
    padded = padded_vocab_size(tokenizer.vocab_size, config["make_vocab_size_divisible_by"], config["model_parallel_size"])
    assert module["sequential.0.word_embeddings.weight"].shape == (padded, config["hidden_size"])
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    qkv = module["sequential.2.attention.query_key_value.weight"]
    assert qkv.shape[0] == (config["num_attention_heads"] + 2 * config["num_kv_heads"]) * head_dim
    assert config["max_position_embeddings"] >= config["seq_length"]
    # Our own loader reads it back as the run that saved it.
    reread = NeoXArgs.from_yaml_files([tag_dir / "configs" / "neox_config.yml"]).with_values(
        {"padded_vocab_size": padded}, "test")
    assert architecture_mismatches(fields_of_settings(stored_client_state(tag_dir)["args"]), reread.architecture().compared_fields()) == []
    return config


# The Llama family on the same data: RMSNorm, SwiGLU, grouped-query attention, no biases, full rotary.
LLAMA_SETTINGS = dict(norm="rmsnorm", activation="swiglu", num_kv_heads=2, rotary_pct=1.0, gpt_j_residual=False,
                      use_bias_in_norms=False, use_bias_in_attn_linear=False, use_bias_in_mlp=False,
                      rms_norm_epsilon=1.0e-6, intermediate_size=3 * 344)  # 344 per projection


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_zero1_bf16_llama_trains_and_saves_per_rank_optimizer_shards(tmp_path):
    save = tmp_path / "ckpt"
    overrides = write_overrides(
        tmp_path, save=str(save), train_iters=30, checkpoint_factor=30, eval_interval=30, num_gpus=2,
        precision="bf16", bf16={"enabled": True}, zero_optimization={"stage": 1}, **LLAMA_SETTINGS,
        # bf16 matrix products are slow on CPUs without AVX-512: short rows keep this test's cost near fp32's
        train_micro_batch_size_per_gpu=2, seq_length=64,
    )
    result = run_deepy(["configs/tiny.yml", overrides])
    assert "2 data-parallel rank(s)" in result.stdout
    assert foreign_notices(result.stdout + result.stderr) == []  # also in every rank's output
    lines = train_lines(result.stdout)
    assert lines[-1].iteration == 30
    assert lines[-1].loss < lines[0].loss - 0.5
    files = checkpoint_files(save / "global_step30")
    for rank in (0, 1):
        assert any(f.endswith(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt") for f in files), files
    weights = read_module_weights(save / "global_step30")
    assert weights["sequential.2.mlp.linear1.weight"].shape == (2 * 344, 128)  # up and gate stacked
    assert weights["sequential.2.attention.query_key_value.weight"].shape == ((4 + 2 * 2) * 32, 128)
    assert "sequential.2.input_layernorm.scale" in weights and not any(k.endswith(".bias") for k in weights)
    config = assert_gpt_neox_config_describes_the_files(save / "global_step30")
    assert config["activation"] == "swiglu" and config["num_kv_heads"] == 2 and config["bf16"]["enabled"]


def _scheduled_lr(step: int) -> float:
    return learning_rate_at(step, peak_lr=0.002, min_lr=0.0002, warmup_iters=5, decay_iters=30,
                            decay_style="cosine")


@pytest.mark.slow
def test_resume_and_no_load_optim_continue_at_the_next_iteration_with_the_scheduled_lr(tmp_path):
    save = tmp_path / "ckpt"
    schedule = {"train_iters": 30, "lr_decay_iters": 30, "warmup": 5 / 30, "checkpoint_factor": 10,
                "eval_interval": 100}
    first = write_overrides(tmp_path, name="first.yml", save=str(save), **{**schedule, "train_iters": 20})
    run_deepy(["configs/tiny.yml", first])
    assert (save / "latest").read_text().strip() == "global_step20"

    resumed = write_overrides(tmp_path, name="resume.yml", save=str(save), load=str(save), **schedule)
    lines = train_lines(run_deepy(["configs/tiny.yml", resumed]).stdout)
    assert lines[0].iteration == 21
    assert lines[0].lr == pytest.approx(_scheduled_lr(21), rel=1e-3)
    assert (save / "latest").read_text().strip() == "global_step30"

    # `latest` now names global_step30; `iteration: 20` picks the older tag. A fresh optimizer
    # starts a fresh schedule (warmup again) while the iteration count carries on.
    fresh_optimizer = write_overrides(tmp_path, name="no_load_optim.yml", save=str(tmp_path / "branch"),
                                      load=str(save), iteration=20, no_load_optim=True, **schedule)
    lines = train_lines(run_deepy(["configs/tiny.yml", fresh_optimizer]).stdout)
    assert lines[0].iteration == 21
    assert lines[0].lr == pytest.approx(_scheduled_lr(1), rel=1e-3)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_stop_together_at_the_first_nonfinite_step_and_keep_the_last_good_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    overrides = write_overrides(
        tmp_path, save=str(save), train_iters=12, checkpoint_factor=1, keep_last_n_checkpoints=None,
        eval_interval=100, num_gpus=2, warmup=0,
        optimizer={"type": "AdamW", "params": {"lr": 1.0e4, "betas": [0.9, 0.95], "eps": 1.0e-8}},
    )
    result = run_deepy(["configs/tiny.yml", overrides], expect_success=False, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    diverged = int(re.search(r"iteration (\d+) \(fp32\): loss \S+, gradient norm \S+.* The run diverged", output)[1])
    saved = sorted(int(p.name.removeprefix("global_step")) for p in save.glob("global_step*"))
    assert [tag for tag in saved if tag] == list(range(1, diverged)), f"saved {saved}, diverged at {diverged}"
    assert (save / "latest").read_text().strip() == f"global_step{diverged - 1}"


@pytest.mark.slow
def test_a_scaled_down_gpt_neox_dmoe_trains_with_sinkhorn_routing_and_reports_its_experts_load(tmp_path):
    """configs/tiny.yml with GPT-NeoX's 125M-dmoe.yml's expert settings (8 experts behind its default router,
    sinkhorn, with activation recomputation) in every other layer; the layers between keep their biased MLP."""
    overrides = write_overrides(tmp_path, moe_num_experts=8, moe_expert_interval=2, checkpoint_activations=True,
                                train_iters=8, eval_interval=1000, log_interval=1, tensorboard_dir=str(tmp_path / "tb"))
    result = run_deepy(["configs/tiny.yml", overrides])
    losses = {int(m[1]): float(m[2]) for m in re.finditer(
        r"iteration\s+(\d+)/8 \| loss ([\d.]+) \| load_balancing_loss [\d.]+ \| max_expert_load [\d.]+ \|", result.stdout)}
    assert list(losses) == list(range(1, 9)), result.stdout[-3000:]
    assert losses[8] < losses[1] - 0.5, losses
    scalars = tensorboard_scalars(tmp_path / "tb")
    for layer in (0, 2):
        for step in range(1, 9):
            loads = [scalars[f"train/expert_load/layer_{layer}/expert_{expert}"][step] for expert in range(8)]
            assert sum(loads) == pytest.approx(1.0, abs=1e-6)
    assert not any(tag.startswith("train/expert_load/layer_1/") for tag in scalars)
    assert "router collapse" not in result.stdout
