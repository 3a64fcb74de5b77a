"""The settings of the model variants (rope_scaling, qk_layernorm, add_qkv_bias, kv_channels, hf_model_type) and of
SGD under ZeRO: refused in one line where they cannot run, kept out of the GPT-NeoX-readable neox_config.yml."""

from __future__ import annotations

import deepspeed
import pytest

from megatron.checkpointing.saving.neox_config import resolved_neox_config, split_by_gpt_neox
from megatron.hf.config import FAMILIES
from megatron.model import build_model
from megatron.neox_arguments import SETTINGS, ConfigError, NeoXArgs
from megatron.optim.optimizers import build_param_groups

MODEL = dict(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8, padded_vocab_size=64,
             pos_emb="rotary", norm="rmsnorm", activation="swiglu", intermediate_size=96)
RUN = dict({k: v for k, v in MODEL.items() if k != "padded_vocab_size"}, train_iters=2,
           train_micro_batch_size_per_gpu=1, embedded_corpus=True)
SGD_ZERO1 = dict(train_iters=2, train_micro_batch_size_per_gpu=1, optimizer={"type": "SGD", "params": {"lr": 0.1}},
                 zero_optimization={"stage": 1})


def write(tmp_path, text: str):
    path = tmp_path / "run.yml"
    path.write_text(text)
    return path


def test_sgd_with_zero_is_refused_before_launch_naming_the_file_and_the_way_out(tmp_path):
    run = write(tmp_path, "num_layers: 1\nhidden_size: 32\nnum_attention_heads: 2\nseq_length: 8\ntrain_iters: 2\n"
                          "train_micro_batch_size_per_gpu: 1\nembedded_corpus: true\n"
                          "optimizer: {type: SGD, params: {lr: 0.1}}\nzero_optimization: {stage: 1}\n")
    with pytest.raises(ConfigError, match=f"{run}: optimizer: type SGD with {run}: zero_optimization stage 1: .*"
                                          "set zero_allow_untested_optimizer: true"):
        NeoXArgs.from_yaml_files([run])


@pytest.mark.usefixtures("single_rank_world")
def test_zero_allow_untested_optimizer_reaches_deepspeed_which_then_builds_sgd_under_zero():
    args = NeoXArgs.from_dict({**MODEL, **SGD_ZERO1, "zero_allow_untested_optimizer": True})
    assert args.deepspeed_config()["zero_allow_untested_optimizer"] is True
    model = build_model(args.architecture(), args.seed)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=args.deepspeed_config(),
                                                   model_parameters=build_param_groups(model, args.weight_decay))
    assert type(optimizer.optimizer).__name__ == "SGD" and engine.zero_optimization_stage() == 1


@pytest.mark.parametrize(("scaling", "expected"), [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' changes the rotary frequencies .* at inference only"),
    ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings missing"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 4}, "beta_fast not known"),
    ({"rope_type": "linear", "factor": -2.0}, r"rope_scaling.factor=-2.0 must be a positive number"),
    ({"rope_type": "su", "factor": 2.0}, "rope_type 'su' is not supported; use one of linear, llama3, yarn"),
])
def test_a_rope_scaling_that_cannot_train_is_one_line_naming_the_file(scaling, expected, tmp_path):
    run = write(tmp_path, f"rope_scaling: {scaling}\n")
    with pytest.raises(ConfigError, match=f"^{run}: .*{expected}"):
        NeoXArgs.from_yaml_files([run], underlay=RUN, underlay_source="model")


def test_gpt_neox_use_qk_layernorm_is_refused_pointing_at_qk_layernorm(tmp_path):
    with pytest.raises(ConfigError, match="use_qk_layernorm .*one norm shared by queries and keys.*qk_layernorm"):
        NeoXArgs.from_yaml_files([write(tmp_path, "use_qk_layernorm: true\n")], underlay=RUN, underlay_source="m")


def test_variant_settings_stay_out_of_the_gpt_neox_config():
    args = NeoXArgs.from_dict({**MODEL, "kv_channels": 32, "qk_layernorm": True, "add_qkv_bias": True,
                               "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "hf_model_type": "qwen3",
                               "zero_allow_untested_optimizer": True})
    gpt_neox, ours = split_by_gpt_neox(resolved_neox_config(args.to_dict()))
    assert gpt_neox["num_layers"] == 1 and gpt_neox["norm"] == "rmsnorm"
    variants = {"kv_channels", "qk_layernorm", "add_qkv_bias", "rope_scaling", "hf_model_type",
                "zero_allow_untested_optimizer"}
    assert not variants & set(gpt_neox)
    assert variants <= set(ours)


def test_hf_model_type_takes_exactly_the_convertible_families():
    assert SETTINGS["hf_model_type"].choices == (None, *FAMILIES)
