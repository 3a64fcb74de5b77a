"""Bad input, round five (issue 52), each refused in one line naming what is wrong, where, and what to do:
settings that a switched-off feature would ignore, numbers no run can use, files that are not config files, a
checkpoint folder that is not there, outputs that would replace their own inputs, and Hugging Face folders whose
tensors disagree with their config.json."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import deepy
from megatron.checkpointing import CheckpointError, inventory_checkpoint
from megatron.generation import GenerationError, check_generation_settings
from megatron.hf import HFConversionError
from megatron.hf.config import spec_from_hf_config
from megatron.hf.convert import convert_hf_to_neox
from megatron.launch.run_context import settings_for_run
from megatron.neox_arguments import ConfigError, NeoXArgs
from tests.e2e.test_hf_conversion import make_hf_model, save_hf
from tests.unit.test_neox_args import TINY_RUN, run_args, write_yaml

RANK_ECHO = "tests/rank_echo.py"
INT64_MAX = 9223372036854775807  # what torch.iinfo(torch.int64).max says; written out, not taken from the code


def refused(tmp_path, **settings) -> str:
    """The one-line ConfigError for a run of TINY_RUN with `settings`; it starts with the file that set them."""
    with pytest.raises(ConfigError) as caught:
        run_args(tmp_path, **settings)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "run.yml")), message
    return message


# --- a setting the switched-off feature would ignore ----------------------------------------------------------

@pytest.mark.parametrize(("settings", "says"), [
    ({"lora_alpha": 16}, "lora_alpha is 16, but lora_rank (default) is 0, which turns LoRA off"),
    ({"lora_rank": 0, "lora_target_modules": ["q_proj"]}, "lora_rank is 0, which turns LoRA off"),
    ({"lora_rank": 0, "lora_target_modules": []}, "lora_target_modules is [], but"),
    ({"lora_use_rslora": True}, "lora_use_rslora is True, but lora_rank (default) is 0"),
    ({"lora_dropout": 0.1}, "lora_dropout is 0.1, but lora_rank (default) is 0"),
])
def test_a_lora_setting_without_lora_is_refused_not_a_silent_full_fine_tune(tmp_path, settings, says):
    message = refused(tmp_path, **settings)
    assert says in message and "set lora_rank to the adapters' rank" in message


@pytest.mark.parametrize(("settings", "says"), [
    ({"moe_top_k": 2}, "moe_top_k is 2, but moe_num_experts (default) is 1, which turns mixture of experts off"),
    ({"moe_num_experts": 1, "moe_router_type": "topk"}, "moe_router_type is 'topk', but"),
    ({"moe_intermediate_size": 128}, "moe_intermediate_size is 128, but moe_num_experts (default) is 1"),
    ({"moe_load_balancing_loss": True}, "moe_load_balancing_loss is True, but moe_num_experts (default) is 1"),
])
def test_an_expert_setting_without_experts_is_refused_not_a_silent_dense_model(tmp_path, settings, says):
    message = refused(tmp_path, **settings)
    assert says in message and "set moe_num_experts to the number of experts" in message


@pytest.mark.parametrize("settings", [{"moe_num_experts": 0}, {"moe_num_experts": 0, "moe_top_k": 2}])
def test_zero_experts_is_refused_not_read_as_one(tmp_path, settings):
    assert "moe_num_experts: must be at least 1, got 0" in refused(tmp_path, **settings)


def test_the_same_settings_with_their_feature_on_and_defaults_written_out_are_accepted(tmp_path):
    args = run_args(tmp_path, lora_rank=8, lora_alpha=16, lora_target_modules=["query_key_value"])
    assert args.lora().rank == 8
    args = run_args(tmp_path, moe_num_experts=4, moe_top_k=2, moe_router_type="topk")
    assert args.moe_top_k == 2
    assert run_args(tmp_path, lora_alpha=8, moe_top_k=1).lora() is None  # the defaults, written out: harmless


def test_gpt_neox_num_experts_points_at_moe_num_experts_which_is_built(tmp_path):
    message = refused(tmp_path, num_experts=4)
    assert "num_experts" in message and "write moe_num_experts instead" in message
    assert "mixture-of-experts is a GPT-NeoX feature not built here" not in message


def test_dry_run_refuses_a_lora_setting_without_lora(tmp_path, capsys):
    config = write_yaml(tmp_path, "run.yml", {**TINY_RUN, "lora_target_modules": "all-linear"})
    assert deepy.main([RANK_ECHO, str(config), "--dry-run"]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "config error" in line]
    assert captured.out == "" and len(lines) == 1
    assert f"{config}: lora_target_modules is 'all-linear', but lora_rank (default) is 0" in lines[0]


# --- numbers no run can use -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("settings", "location"), [
    ({"train_iters": 2**64}, "train_iters: 18446744073709551616"),
    ({"train_iters": "1e30"}, "train_iters: 1000000000000000019884624838656"),
    ({"iteration": 2**63}, "iteration: 9223372036854775808"),
    ({"lr_decay_iters": -2**70}, "lr_decay_iters: -1180591620717411303424"),
    ({"extra_save_iters": [10, 2**64]}, "extra_save_iters[1]: 18446744073709551616"),
    ({"zero_optimization": {"stage": 1, "reduce_bucket_size": 2**80}}, "zero_optimization.reduce_bucket_size: "),
])
def test_a_number_beyond_64_bits_is_refused_naming_the_bound(tmp_path, settings, location):
    message = refused(tmp_path, **settings)
    assert location in message and f"at most {INT64_MAX}" in message and "give a smaller value" in message


def test_iterations_whose_samples_no_64_bit_count_holds_are_refused(tmp_path):
    message = refused(tmp_path, train_iters=2**62)  # x 2 samples a step: 2**63, one beyond the bound
    assert f"train_iters: {2**62} iterations of 2 samples are more samples than a 64-bit integer counts" in message
    assert run_args(tmp_path, train_iters=2**61).train_iters == 2**61


@pytest.mark.parametrize(("model", "rank", "says"), [
    ({}, 65, "lora_rank: 65 is above 64, the smaller side of the adapted layer query_key_value (192 x 64)"),
    ({"norm": "rmsnorm", "activation": "swiglu", "num_kv_heads": 1, "lora_target_modules": ["q_proj", "k_proj"]}, 17,
     "lora_rank: 17 is above 16, the smaller side of the adapted layer k_proj (16 x 64)"),
    ({}, 10**12, "lora_rank: 1000000000000 is above 64"),
])
def test_a_lora_rank_beyond_the_adapted_layer_is_refused_naming_the_layer_and_bound(tmp_path, model, rank, says):
    message = refused(tmp_path, lora_rank=rank, **model)
    assert says in message and "set lora_rank to at most" in message
    assert run_args(tmp_path, lora_rank=rank - 1 if rank < 100 else 64, **model).lora() is not None


def test_dry_run_refuses_an_iteration_count_beyond_64_bits(tmp_path, capsys):
    config = write_yaml(tmp_path, "run.yml", {**TINY_RUN, "train_iters": 2**64})
    assert deepy.main([RANK_ECHO, str(config), "--dry-run"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "config error" in line]
    assert len(lines) == 1 and f"{config}: train_iters: {2**64} is beyond the 64-bit integers" in lines[0]


# --- inputs that cannot be read as what they are named as -----------------------------------------------------

@pytest.mark.parametrize(("content", "says"), [
    (b"\x80\x02}q\x00(X\x05\x00\x00\x00model", "byte 0 is not UTF-8 text"),
    (b"num_layers: 2\nhidden_size: \x00\x01\x02\n", "byte 27 is a NUL byte"),
])
def test_a_config_file_that_is_not_text_is_one_line(tmp_path, content, says):
    config = tmp_path / "model.yml"
    config.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        NeoXArgs.from_yaml_files([config])
    message = str(caught.value)
    assert message.startswith(f"config file {config}: {says}") and "name the YAML file of settings" in message
    assert "\n" not in message


def test_a_yaml_syntax_error_is_one_line_naming_the_file_and_position(tmp_path):
    config = write_yaml(tmp_path, "run.yml", "num_layers: 2\n  hidden_size: [64\n")
    with pytest.raises(ConfigError) as caught:
        NeoXArgs.from_yaml_files([config])
    assert str(caught.value).startswith(f"{config}: not valid YAML: ") and "line 2" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_load_folder_that_does_not_exist_says_so_not_that_it_has_no_latest_file(tmp_path):
    missing = tmp_path / "no_such_run"
    config = write_yaml(tmp_path, "run.yml", {"load": str(missing), "train_iters": 10,
                                              "train_micro_batch_size_per_gpu": 2, "embedded_corpus": True})
    with pytest.raises(ConfigError) as caught:
        settings_for_run([str(config)])
    message = str(caught.value)
    assert message.startswith(f"load: {missing} does not exist; name the checkpoint folder") and "latest" in message
    assert "has no `latest` file" not in message


def test_converting_a_checkpoint_folder_that_does_not_exist_says_so(tmp_path):
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'gone'} does not exist; name the checkpoint folder"):
        inventory_checkpoint(tmp_path / "gone").chosen_tag(pick_with="--tag {tag}")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        inventory_checkpoint(tmp_path / "a_file").chosen_tag()


# --- no output written over its own input ---------------------------------------------------------------------

def generation_args(tmp_path, **settings) -> NeoXArgs:
    load = tmp_path / "ckpt"
    load.mkdir(exist_ok=True)
    return NeoXArgs.from_dict({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                               "load": str(load), "text_gen_type": "input-file", **settings})


@pytest.mark.parametrize("output", ["prompts.txt", "./prompts.txt", "ckpt", "ckpt/samples.jsonl"])
def test_generate_py_refuses_a_sample_output_file_that_is_its_prompt_file_or_in_its_checkpoint(tmp_path, output,
                                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n")
    args = generation_args(tmp_path, sample_input_file=str(prompts), sample_output_file=output)
    with pytest.raises(GenerationError) as caught:
        check_generation_settings(args)
    message = str(caught.value)
    assert message.startswith(f"sample_output_file {output} is, holds or lies in the input ")
    assert "write the output to a file or folder of its own" in message and "\n" not in message
    assert prompts.read_text() == "a prompt\n"


def test_generate_py_accepts_an_output_file_of_its_own_and_the_default_beside_the_prompts(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n")
    check_generation_settings(generation_args(tmp_path, sample_input_file=str(prompts),
                                              sample_output_file=str(tmp_path / "samples.jsonl")))
    check_generation_settings(generation_args(tmp_path, sample_input_file=str(prompts)))


def test_convert_hf_to_neox_refuses_a_config_out_inside_the_folder_it_reads(tmp_path):
    hf_dir = save_hf(make_hf_model("llama_gqa"), tmp_path / "hf")
    before = (hf_dir / "config.json").read_bytes()
    with pytest.raises(HFConversionError, match=r"--config-out .*config\.json is, holds or lies in the input"):
        convert_hf_to_neox(hf_dir, tmp_path / "out", config_out=hf_dir / "config.json", overwrite=True)
    assert (hf_dir / "config.json").read_bytes() == before and not (tmp_path / "out").exists()


# --- Hugging Face folders whose tensors disagree with their config --------------------------------------------

def spoiled_folder(tmp_path, kind: str, name: str, shape: tuple[int, ...]):
    """A saved folder of `kind` whose tensor `name` is replaced by one of `shape`."""
    hf_dir = save_hf(make_hf_model(kind), tmp_path / "hf")
    tensors = load_file(hf_dir / "model.safetensors")
    assert name in tensors and tuple(tensors[name].shape) != shape
    tensors[name] = torch.zeros(shape)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    return hf_dir


@pytest.mark.parametrize(("kind", "name", "shape", "expected"), [
    ("llama_gqa", "model.layers.1.self_attn.o_proj.weight", (64, 48), "(64, 64)"),
    ("llama_gqa", "model.layers.0.self_attn.k_proj.weight", (64, 64), "(32, 64)"),
    ("neox_parallel", "gpt_neox.layers.0.mlp.dense_h_to_4h.weight", (255, 64), "(256, 64)"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.1.w1.weight", (95, 64), "(96, 64)"),
    ("mixtral", "model.layers.1.block_sparse_moe.gate.weight", (5, 64), "(4, 64)"),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert.down_proj.weight", (64, 12), None),
])
def test_a_tensor_of_another_shape_than_its_config_gives_is_refused_before_anything_is_written(
        tmp_path, kind, name, shape, expected):
    hf_dir = spoiled_folder(tmp_path, kind, name, shape)
    with pytest.raises(HFConversionError) as caught:
        convert_hf_to_neox(hf_dir, tmp_path / "out")
    message = str(caught.value)
    assert message.startswith(f"{hf_dir / 'model.safetensors'}: {name} has shape {shape}, but config.json beside it "
                              "gives ")
    if expected is not None:
        assert f"gives {expected};" in message
    assert "\n" not in message and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("kind", "change", "says"), [
    ("mixtral", {"num_local_experts": -4}, "num_local_experts / num_experts is -4; a mixture of experts needs"),
    ("qwen3_moe", {"num_experts": -1}, "num_local_experts is 4 but num_experts is -1"),  # -1 went unread
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step is 0; it must be a positive whole number"),
    ("qwen2_moe", {"decoder_sparse_step": -1}, "decoder_sparse_step is -1; it must be a positive whole number"),
    ("mixtral", {"num_local_experts": 4, "num_experts": 8}, "num_local_experts is 4 but num_experts is 8"),
])
def test_an_moe_config_no_model_can_have_is_refused(kind, change, says):
    config = {**make_hf_model(kind).config.to_dict(), **change}
    with pytest.raises(HFConversionError) as caught:
        spec_from_hf_config(config, "config.json")
    assert str(caught.value).startswith(f"config.json: {says}") and "\n" not in str(caught.value)


def test_every_family_saved_by_transformers_passes_the_shape_check(tmp_path):
    """The check refuses nothing transformers itself writes (each tensor of every family has its rule)."""
    from megatron.hf.folder_weights import read_hf_model
    from tests.e2e.test_hf_conversion import FAMILIES

    for kind in FAMILIES:
        hf_dir = save_hf(make_hf_model(kind), tmp_path / kind)
        spec, weights = read_hf_model(hf_dir)
        assert weights, kind
    assert json.loads((tmp_path / "olmoe" / "config.json").read_text())["model_type"] == "olmoe"
