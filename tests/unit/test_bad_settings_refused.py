"""Settings and inputs whose values make an objective or a model meaningless are refused before the first step,
--dry-run included, each in one line with its allowed range: objective coefficients, data weights, generation
lengths, rewards that are not finite numbers, weights of a dtype the model cannot train from or holding NaN."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import deepy
from megatron.data import DataError, MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.gpt_dataset import GPTDataset
from megatron.hf import HFConversionError
from megatron.hf.folder_weights import read_hf_model
from megatron.neox_arguments import ConfigError
from tests.e2e.test_hf_conversion import hf_reference, make_hf_model, save_hf
from tests.e2e.test_preprocess_chat import CHAT, make_chat_tokenizer, run, write_jsonl
from tests.unit.test_data_gpt_dataset import write_documents
from tests.unit.test_neox_args import TINY_RUN, run_args, write_yaml

RANK_ECHO = "tests/rank_echo.py"


@pytest.mark.parametrize(("settings", "says"), [
    ({"dpo_beta": 0}, "dpo_beta: must be positive"),
    ({"dpo_beta": -0.1}, "dpo_beta: must be positive"),
    ({"kto_beta": 0.0}, "kto_beta: must be positive"),
    ({"kto_desirable_weight": -1.0}, "kto_desirable_weight: must be positive"),
    ({"kto_undesirable_weight": 0}, "kto_undesirable_weight: must be positive"),
    ({"z_loss": -0.01}, "z_loss: must not be negative"),
    ({"maximum_tokens": 0}, "maximum_tokens: must be at least 1"),
    ({"num_samples": 0}, "num_samples: must be at least 1"),
    ({"top_p": 1.5}, "top_p: must be a probability in [0, 1]"),
    ({"top_k": -1}, "top_k: must not be negative"),
    ({"temperature": -0.5}, "temperature: must not be negative"),
])
def test_a_coefficient_outside_its_definition_is_one_line_with_the_range(tmp_path, settings, says):
    with pytest.raises(ConfigError) as caught:
        run_args(tmp_path, **settings)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'run.yml'}: ") and says in message and "\n" not in message
    assert f"got {next(iter(settings.values()))}" in message


def test_the_defaults_and_the_edges_of_each_range_are_accepted(tmp_path):
    args = run_args(tmp_path, dpo_beta=1e-6, kto_desirable_weight=1.33, z_loss=0, top_p=1.0, top_k=0,
                    temperature=0.0, maximum_tokens=1, num_samples=1)
    assert args.dpo_beta == 1e-6 and args.z_loss == 0


@pytest.mark.parametrize(("weights", "says"), [
    ([1.0, -0.5], "must be finite and non-negative with a positive sum"),
    ([0, 0], "must be finite and non-negative with a positive sum"),
    (["a", 1], "must be numbers"),
])
def test_data_weights_outside_their_meaning_are_refused_by_the_settings(tmp_path, weights, says):
    with pytest.raises(ConfigError, match="train_data_weights") as caught:
        run_args(tmp_path, embedded_corpus=False, train_data_paths=["a", "b"], train_data_weights=weights,
                 tokenizer_type="ByteLevelTokenizer")
    assert says in str(caught.value)


def test_dry_run_refuses_a_flipped_objective_in_one_line(tmp_path, capsys):
    config = write_yaml(tmp_path, "dpo.yml", {**TINY_RUN, "dpo_beta": -0.1})
    assert deepy.main([RANK_ECHO, str(config), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if "config error" in line]
    assert len(lines) == 1 and f"{config}: dpo_beta: must be positive" in lines[0]


# --- rewards ---------------------------------------------------------------------------------------------------

def _reward_file(prefix, values, dtype) -> MMapIndexedDataset:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for value in values:
        builder.add_item([value])
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return MMapIndexedDataset(prefix)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_reward_file_with_a_value_that_is_not_finite_is_refused_when_opened(tmp_path, bad):
    data = MMapIndexedDataset(write_documents(tmp_path / "text", [np.arange(1, 6)] * 3))
    rewards = _reward_file(tmp_path / "reward", [1.0, bad, -1.0], np.float32)
    with pytest.raises(DataError) as caught:
        GPTDataset("train", data, np.arange(3), 4, 8, 1, pack_impl="unpacked", reward_dataset=rewards)
    message = str(caught.value)
    assert f"document 1 has reward {bad}" in message and "finite number" in message and str(tmp_path) in message


def test_a_reward_that_is_not_finite_in_a_chat_record_is_one_line_with_file_and_line(tmp_path):
    tokenizer = make_chat_tokenizer(tmp_path / "tokenizer")
    source = tmp_path / "scored.jsonl"
    source.write_text(json.dumps({"conversation": CHAT, "r": 1}) + "\n"
                      + json.dumps({"conversation": CHAT, "r": float("nan")}) + "\n")  # json writes NaN
    with pytest.raises(SystemExit) as stopped:
        run("--input", str(source), "--tokenizer-path", str(tokenizer), "--output-prefix", str(tmp_path / "x"),
            "--reward-key", "r")
    message = str(stopped.value)
    assert f"{source}:2: reward field 'r' is nan" in message and "finite number" in message and "\n" not in message


def test_a_large_whole_reward_is_written_as_the_number_it_is_not_refused_as_a_token_id(tmp_path):
    tokenizer = make_chat_tokenizer(tmp_path / "tokenizer")
    source = write_jsonl(tmp_path / "scored.jsonl", [{"conversation": CHAT, "r": 3_000_000_000},
                                                     {"conversation": CHAT, "r": -2}])
    run("--input", source, "--tokenizer-path", str(tokenizer), "--output-prefix", str(tmp_path / "x"),
        "--reward-key", "r")
    rewards = MMapIndexedDataset(tmp_path / "x_conversation_reward_document")
    assert rewards.dtype == np.float32 and rewards.values().tolist() == [3e9, -2.0]


def test_a_reward_beyond_float32_is_refused_naming_the_record(tmp_path):
    tokenizer = make_chat_tokenizer(tmp_path / "tokenizer")
    source = write_jsonl(tmp_path / "scored.jsonl", [{"conversation": CHAT, "r": 10**40}])
    with pytest.raises(SystemExit) as stopped:
        run("--input", source, "--tokenizer-path", str(tokenizer), "--output-prefix", str(tmp_path / "x"),
            "--reward-key", "r")
    message = str(stopped.value)
    assert f"{source}:1: reward field 'r'" in message and "float32's range" in message
    assert "token id" not in message


# --- weights as they are read ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("spoil", "says"), [
    (lambda t: t.index_fill_(0, torch.tensor([1]), float("nan")), "holds 64 NaN or infinite values"),
    (lambda t: t.fill_(float("inf")), "NaN or infinite values"),
    (lambda t: t.to(torch.int8), "is int8, not a floating-point type the model trains from"),
])
def test_hf_weights_the_model_cannot_train_from_are_refused_as_they_are_read(tmp_path, spoil, says):
    model = make_hf_model("llama_gqa")
    hf_dir = save_hf(model, tmp_path / "hf")
    state = {name: tensor.clone().contiguous() for name, tensor in hf_reference(model).items()}
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name] = spoil(state[name])
    save_file(state, str(hf_dir / "model.safetensors"))
    with pytest.raises(HFConversionError) as caught:
        read_hf_model(hf_dir, torch.float32)
    message = str(caught.value)
    assert str(hf_dir) in message and repr(name) in message and says in message


@pytest.mark.usefixtures("single_rank_world")
def test_checkpoint_weights_holding_nan_are_refused_before_training_from_them(tmp_path):
    from megatron.checkpointing.errors import CheckpointError
    from megatron.launch.run_context import resolve_run_settings
    from megatron.model import build_model
    from megatron.neox_arguments import NeoXArgs
    from megatron.training.loop import setup_for_inference
    from tests.e2e.test_ckpt_gpt_neox_checkpoints import write_gpt_neox_pipeline_checkpoint

    config = write_yaml(tmp_path, "run.yml", {**TINY_RUN, "load": str(tmp_path / "neox")})
    args = resolve_run_settings(NeoXArgs.from_yaml_files([config]))
    model = build_model(args.architecture(), args.seed)
    with torch.no_grad():
        model.layers[1].mlp.linear1.weight[0, 0] = float("nan")
    tag_dir = write_gpt_neox_pipeline_checkpoint(model, tmp_path / "neox")
    with pytest.raises(CheckpointError) as caught:
        setup_for_inference(args)
    message = str(caught.value)
    assert message.startswith(f"{tag_dir}: tensor ") and "holds 1 NaN or infinite values" in message


# --- --dry-run checks the files a run names as the start does ---------------------------------------------------

DOCUMENTS = [np.arange(1, 11)] * 6  # 6 documents of 10 tokens


def _own_data_run(tmp_path, **settings) -> str:
    return str(write_yaml(tmp_path, "run.yml", {**TINY_RUN, "embedded_corpus": False, "tokenizer_type": "ByteLevelTokenizer",
                                                "pack_impl": "unpacked", "eval_iters": 0, **settings}))


def _dry_run_error(config: str, capsys) -> str:
    assert deepy.main([RANK_ECHO, config, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if line.startswith("deepy.py:")]
    assert len(lines) == 1, captured.err
    return lines[0]


def test_dry_run_refuses_a_label_file_of_other_documents(tmp_path, capsys):
    data = write_documents(tmp_path / "text", DOCUMENTS)
    labels = write_documents(tmp_path / "label", DOCUMENTS[:5], np.int32)
    line = _dry_run_error(_own_data_run(tmp_path, train_data_paths=[data], train_label_data_paths=[labels]), capsys)
    assert f"label dataset '{labels}' does not match '{data}': 5 and 6 documents" in line


def test_dry_run_refuses_a_reward_file_of_other_documents(tmp_path, capsys):
    data = write_documents(tmp_path / "text", DOCUMENTS)
    rewards = write_documents(tmp_path / "reward", [np.ones(1, np.float32)] * 4, np.float32)
    config = _own_data_run(tmp_path, train_impl="kto", train_data_paths=[data], train_label_data_paths=[data],
                           train_reward_data_paths=[rewards])
    assert f"reward dataset '{rewards}' holds 4 documents for the 6 documents" in _dry_run_error(config, capsys)


def test_dry_run_refuses_rejected_documents_that_do_not_pair_with_the_chosen(tmp_path, capsys):
    chosen = write_documents(tmp_path / "chosen", DOCUMENTS)
    rejected = write_documents(tmp_path / "rejected", DOCUMENTS[:3])
    config = _own_data_run(tmp_path, train_impl="dpo", dataset_impl="pairwise", dpo_reference_free=True,
                           pos_train_data_paths=[chosen], neg_train_data_paths=[rejected])
    assert f"'{chosen}' holds 6 documents but '{rejected}' holds 3" in _dry_run_error(config, capsys)


def test_dry_run_refuses_precomputed_log_probabilities_of_another_length(tmp_path, capsys):
    chosen = write_documents(tmp_path / "chosen", DOCUMENTS)
    rejected = write_documents(tmp_path / "rejected", DOCUMENTS)
    for prefix in (chosen, rejected):
        write_documents(f"{prefix}_ref", [np.zeros(16, np.float32)] * 6, np.float32)  # seq_length is 32
    config = _own_data_run(tmp_path, train_impl="dpo", dataset_impl="pairwise", precompute_model_name="ref",
                           pos_train_data_paths=[chosen], neg_train_data_paths=[rejected],
                           pos_train_label_data_paths=[chosen], neg_train_label_data_paths=[rejected])
    line = _dry_run_error(config, capsys)
    assert f"precomputed log-probabilities '{chosen}_ref' hold 6 float32 documents of [16] values" in line


MASKED = [np.full(10, -100, np.int32)] * 6  # labels that train nothing


@pytest.mark.parametrize("case", ["every label masked", "every document too long", "every rejected label masked"])
def test_dry_run_refuses_a_split_without_a_document_a_sample_can_use(tmp_path, capsys, case):
    """Found before only while the sample index was built, at start-up; the dry run reads the sizes and, up to the
    first usable document, the labels."""
    data = write_documents(tmp_path / "text", DOCUMENTS)
    if case == "every label masked":
        config = _own_data_run(tmp_path, train_data_paths=[data],
                               train_label_data_paths=[write_documents(tmp_path / "label", MASKED, np.int32)])
    elif case == "every document too long":
        config = _own_data_run(tmp_path, train_data_paths=[data], allow_chopped=False, seq_length=8)
    else:
        rejected = write_documents(tmp_path / "rejected", DOCUMENTS)
        config = _own_data_run(tmp_path, train_impl="dpo", dataset_impl="pairwise", dpo_reference_free=True,
                               pos_train_data_paths=[data], neg_train_data_paths=[rejected],
                               pos_train_label_data_paths=[data],
                               neg_train_label_data_paths=[write_documents(tmp_path / "label", MASKED, np.int32)])
    line = _dry_run_error(config, capsys)
    assert f"of '{data}' has no document to sample with pack_impl unpacked: every one is " in line
    assert ("longer than seq_length + 1 or without a trained label" if case == "every document too long"
            else "without a trained label") in line


def test_dry_run_refuses_a_data_path_that_is_not_there_and_passes_what_the_start_passes(tmp_path, capsys):
    missing = str(tmp_path / "nowhere_text_document")
    assert f"{missing}.bin' does not exist" in _dry_run_error(_own_data_run(tmp_path, data_path=missing), capsys)
    data = write_documents(tmp_path / "text", [np.arange(1, 60)] * 40)
    assert deepy.main([RANK_ECHO, _own_data_run(tmp_path, data_path=data, pack_impl="packed"), "--dry-run"]) == 0


def test_generate_py_without_load_asks_for_load_not_for_the_model_shape(tmp_path, capsys):
    config = write_yaml(tmp_path, "generate.yml", {"text_gen_type": "unconditional", "maximum_tokens": 8})
    assert deepy.main(["generate.py", str(config), "--dry-run"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("deepy.py: config error: load: not set (nor num_layers): generate.py and eval.py")
