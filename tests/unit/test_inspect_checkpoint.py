"""tools/ckpts/inspect_checkpoint.py on every kind of checkpoint we can produce, run as a user runs it."""

from __future__ import annotations

import json

import pytest

from megatron.checkpointing import save_checkpoint
from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.hf.convert import convert_hf_to_neox
from tests.e2e.test_hf_conversion import make_hf_model, run_tool, save_hf, tokens, write_pipeline_checkpoint
from tests.unit.test_hf_engine import build_engine, engine_args, engine_loss


def inspect(*arguments) -> dict:
    result = run_tool("inspect_checkpoint.py", *map(str, arguments), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def possible_modes(report: dict) -> set[str]:
    return {mode for mode, verdict in report["load_modes"].items() if verdict["possible"]}


def test_converted_checkpoint_and_hf_folder(tmp_path):
    model = make_hf_model("qwen3")
    hf_dir = save_hf(model, tmp_path / "hf")
    convert_hf_to_neox(hf_dir, tmp_path / "ckpt", dtype="bf16")
    expected_parameters = sum(p.numel() for p in model.parameters())

    ours = inspect(tmp_path / "ckpt")
    assert (ours["format"], ours["latest"], ours["tag"], ours["iteration"]) == ("deepspeed", "global_step0",
                                                                                "global_step0", 0)
    assert ours["parameters"]["elements_by_dtype"] == {"bfloat16": expected_parameters}
    assert ours["optimizer_states"] == {"in_model_states_file": False, "zero_shard_dp_ranks": [], "universal": False}
    assert ours["saved_settings"]["num_kv_heads"] == 2 and ours["saved_settings"]["norm"] == "rmsnorm"
    assert possible_modes(ours) == {"no_load_optim", "finetune"}
    assert "holds none" in ours["load_modes"]["resume"]["reason"]
    variants = ("grouped-query attention (2 key/value heads); heads 32 wide (kv_channels; hidden_size / heads is 16); "
                "per-head query/key norm (qk_layernorm)")
    assert ours["model"] == f"qwen3, {variants}"
    assert f"model:  qwen3, {variants}" in ours["load_modes"]["finetune"]["plan"]

    hf = inspect(hf_dir)
    assert hf["format"] == "hf" and hf["hf_family"] == "qwen3" and hf["model"] == f"qwen3, {variants}"
    assert hf["parameters"]["elements_by_dtype"] == {"float32": expected_parameters}
    assert possible_modes(hf) == {"finetune"}


def test_a_checkpoint_converted_for_two_tensor_parallel_ranks_lists_the_modes_a_run_at_that_size_gets(tmp_path):
    hf_dir = save_hf(make_hf_model("llama_gqa"), tmp_path / "hf")
    convert_hf_to_neox(hf_dir, tmp_path / "ckpt", model_parallel_size=2)
    report = inspect(tmp_path / "ckpt")
    assert report["tensor_parallel_size"] == 2 and report["saved_settings"]["model_parallel_size"] == 2
    assert possible_modes(report) == {"no_load_optim", "finetune"}
    assert "holds none" in report["load_modes"]["resume"]["reason"]
    assert report["full_resume_at"] == {"parallel_sizes": [], "zero_stages_and_precisions": []}


@pytest.mark.usefixtures("single_rank_world")
def test_zero2_engine_checkpoint_can_resume(tmp_path):
    args = engine_args(make_hf_model("neox_parallel"), "bf16", save=str(tmp_path / "run"))
    engine = build_engine(args)
    engine.backward(engine_loss(engine, tokens()))
    engine.step()
    save_checkpoint(args, engine, iteration=3, consumed_train_samples=6)
    report = inspect(tmp_path / "run")
    assert (report["tag"], report["iteration"], report["zero_stage"], report["precision"]) == ("global_step3", 3, 2,
                                                                                                "bf16")
    assert report["optimizer_states"]["zero_shard_dp_ranks"] == [0]
    assert report["parameters"]["parameters"] == sum(p.numel() for p in engine.module.parameters())
    assert possible_modes(report) == {"resume", "no_load_optim", "finetune"}
    # saved at DP 1 x TP 1, ZeRO-2, bf16: the optimizer shards reshard to any of these (the model has 4 heads;
    # DeepSpeed's optimizers without ZeRO have no per-parameter state to restore the moments into)
    assert report["full_resume_at"] == {
        "parallel_sizes": [f"DP {dp} x TP {tp}" for tp in (1, 2) for dp in (1, 2, 4)],
        "zero_stages_and_precisions": [f"ZeRO-{z} {p}" for z in (1, 2, 3) for p in ("fp32", "fp16", "bf16")]}


@pytest.mark.slow
def test_pipeline_checkpoint_and_diff(tmp_path):
    hf_dir = save_hf(make_hf_model("neox_parallel"), tmp_path / "hf")
    convert_hf_to_neox(hf_dir, tmp_path / "ckpt")
    write_pipeline_checkpoint(read_module_weights(tmp_path / "ckpt" / "global_step0"), tmp_path / "pipe", True)
    report = inspect(tmp_path / "pipe")
    assert (report["format"], report["tag"], report["iteration"]) == ("pipeline", "global_step7", 7)
    assert "pipeline checkpoint" in report["load_modes"]["resume"]["reason"]

    same = inspect(tmp_path / "ckpt", "--diff", hf_dir)
    assert same["max_abs_difference"] == {} and same["only_in_first"] == same["only_in_second"] == []
    assert same["identical_tensors"] == len(read_module_weights(tmp_path / "ckpt" / "global_step0"))

    other_dir = save_hf(make_hf_model("neox_sequential_tied", seed=1), tmp_path / "other")
    different = inspect(tmp_path / "ckpt", "--diff", other_dir)
    assert different["only_in_first"] == ["sequential.6.final_linear.weight"]
    assert different["max_abs_difference"]["sequential.0.word_embeddings.weight"] > 0.1
