"""GPT-NeoX's own checkpoints: pipeline layer files with GPT-NeoX's older MLP names load as they are and
fine-tune from exactly their weights; a non-strict load lists what did not load and refuses to leave a
whole layer random unless told to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.loading.module_load import load_module_only
from megatron.checkpointing.ondisk.layout import layer_file_name, model_states_name
from megatron.checkpointing.ondisk.module_weights import (
    legacy_names_in_model_states_file,
    read_module_weights,
)
from megatron.data import build_data_iterators, get_batch
from megatron.data.builders import samples_per_split
from megatron.data.data_settings import DataSettings
from megatron.launch.run_context import resolve_run_settings
from megatron.model import GPTModel, build_model, causal_lm_loss
from megatron.neox_arguments import NeoXArgs
from tests.ckpt_engines import build_engine, ds_config
from tests.deepy_runs import REPO_ROOT, run_deepy, train_lines, write_overrides

# GPT-NeoX's ParallelMLP named its two linears so until it renamed them linear1 / linear2.
OLD_MLP_NAMES = {"mlp.linear1.": "mlp.dense_h_to_4h.", "mlp.linear2.": "mlp.dense_4h_to_h."}
SAVED_ITERATION = 50


def old_mlp_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {}
    for name, tensor in state.items():
        for new, old in OLD_MLP_NAMES.items():
            name = name.replace(new, old)
        renamed[name] = tensor
    return renamed


def old_llama_mlp_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-NeoX's first Llama MLP: silu(w1(x)) * w3(x) through w2, where linear1 now stacks up (w3) and gate (w1)."""
    renamed = {}
    for name, tensor in state.items():
        if name == "mlp.linear1.weight":
            up, gate = tensor.chunk(2)
            renamed["mlp.w1.weight"], renamed["mlp.w3.weight"] = gate.clone(), up.clone()
        else:
            renamed[name.replace("mlp.linear2.", "mlp.w2.")] = tensor
    return renamed


def write_gpt_neox_pipeline_checkpoint(model: GPTModel, root: Path, rename=old_mlp_names) -> Path:
    """The layout GPT-NeoX's PipelineModule saves: one file per pipeline position that holds weights
    (0 embedding, 2.. transformer layers, num_layers + 3 final norm, num_layers + 4 untied output layer),
    keys relative to that layer, older MLP names, the rotary inv_freq buffer it kept in every layer, and
    an mp_rank file with the client state but no module."""
    tag_dir = root / f"global_step{SAVED_ITERATION}"
    tag_dir.mkdir(parents=True)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in model.state_dict().items():
        _, position, rest = name.split(".", 2)
        layers.setdefault(int(position), {})[rest] = tensor.clone()
    layers = {position: rename(state) for position, state in layers.items()}
    rotary_dims = model.arch.rotary_ndims
    inv_freq = 1.0 / (model.arch.rotary_emb_base ** (torch.arange(0, rotary_dims, 2).float() / rotary_dims))
    for position, state in layers.items():
        if any(key.startswith("attention.") for key in state):
            state["attention.rotary_emb.inv_freq"] = inv_freq
        torch.save(state, tag_dir / layer_file_name(position, 0))
    torch.save({"module": None, "iteration": SAVED_ITERATION, "global_steps": SAVED_ITERATION},
               tag_dir / model_states_name(0))
    (root / "latest").write_text(tag_dir.name)
    return tag_dir


@pytest.mark.e2e
@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.slow
def test_pipeline_layer_files_with_old_mlp_names_fine_tune_from_their_weights(tmp_path):
    overrides = write_overrides(tmp_path, "finetune.yml", load=str(tmp_path / "neox"), save=str(tmp_path / "ours"),
                                finetune=True, train_iters=2, checkpoint_factor=2, eval_interval=1000)
    args = resolve_run_settings(NeoXArgs.from_yaml_files([REPO_ROOT / "configs/tiny.yml", overrides]))
    model = build_model(args.architecture(), args.seed + 7)  # not the weights the run would start from on its own
    with torch.no_grad():  # a model whose MLPs matter: its loss moves far when they are re-drawn
        for layer in model.layers:
            layer.mlp.linear2.weight.mul_(20)
    tag_dir = write_gpt_neox_pipeline_checkpoint(model, tmp_path / "neox")
    assert sorted(p.name for p in tag_dir.iterdir())[:2] == ["layer_00-model_00-model_states.pt",
                                                              "layer_02-model_00-model_states.pt"]
    read = read_module_weights(tag_dir)
    assert list(read) == list(model.state_dict())
    assert all(torch.equal(read[name], tensor) for name, tensor in model.state_dict().items())

    # The model's own loss on the run's first batch, and that of the same model with its MLPs re-drawn
    # (what a load that skipped the old names would train from).
    train_iterator, _, _ = build_data_iterators(args, samples_per_split(DataSettings.from_args(args)), 0, 1, 0)
    batch = get_batch(next(train_iterator))
    tokens, labels, loss_mask = batch.tokens, batch.labels, batch.loss_mask
    with torch.no_grad():
        own_loss = causal_lm_loss(model(tokens), labels, loss_mask).item()
        for layer in model.layers:
            torch.nn.init.normal_(layer.mlp.linear1.weight, std=0.02)
            torch.nn.init.normal_(layer.mlp.linear2.weight, std=0.02)
        redrawn_loss = causal_lm_loss(model(tokens), labels, loss_mask).item()
    assert abs(own_loss - redrawn_loss) > 0.05

    result = run_deepy([REPO_ROOT / "configs/tiny.yml", overrides])
    first = train_lines(result.stdout)[0]
    assert first.iteration == 1
    assert first.loss == pytest.approx(own_loss, abs=1e-4)  # the log prints 4 decimals
    assert "format pipeline" in result.stdout + result.stderr


# Non-strict loads, on a small model of real DeepSpeed engines: blocks.<i>.{norm,up,down}, embed, head.

@pytest.fixture
def engine():
    return build_engine(ds_config("fp32", 1), seed=3)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    source = build_engine(ds_config("fp32", 0), seed=seed)
    return {name: tensor.detach().clone() for name, tensor in source.module.state_dict().items()}


@pytest.mark.usefixtures("single_rank_world")
def test_non_strict_load_refuses_to_leave_a_whole_layer_random(engine):
    weights = _weights(seed=5)
    del weights["blocks.1.up.weight"], weights["blocks.1.up.bias"]
    before = engine.module.state_dict()["blocks.0.up.weight"].clone()
    with pytest.raises(CheckpointError, match=r"no weights for 1 whole layer\(s\) of the model \(blocks\.1\.up\)"
                                              r".*load_module_allow_random.*'blocks\.1\.up\.\*'"):
        load_module_only(engine, weights, strict=False)
    assert not torch.equal(before, weights["blocks.0.up.weight"])
    assert torch.equal(before, engine.module.state_dict()["blocks.0.up.weight"]), "a refused load wrote weights"


@pytest.mark.usefixtures("single_rank_world")
def test_non_strict_load_with_an_allow_list_lists_every_key_it_did_not_load(engine):
    weights = _weights(seed=5)
    del weights["blocks.1.up.weight"], weights["blocks.1.up.bias"], weights["blocks.0.norm.bias"]
    weights["blocks.0.down.weight"] = torch.zeros(3, 3)
    weights["extra.weight"] = torch.zeros(2)
    report = load_module_only(engine, weights, strict=False, allow_random=["blocks.1.up.*"])
    assert report.missing == ["blocks.0.norm.bias", "blocks.1.up.weight", "blocks.1.up.bias"]
    assert report.unexpected == ["extra.weight"]
    assert report.mismatched == [("blocks.0.down.weight", (3, 3), (24, 29))]
    text = report.describe()
    for name in ("blocks.0.norm.bias", "blocks.1.up.weight", "blocks.1.up.bias", "extra.weight", "blocks.0.down.weight"):
        assert name in text
    loaded = engine.module.state_dict()
    assert torch.equal(loaded["blocks.1.down.weight"], weights["blocks.1.down.weight"])
    # One tensor of a layer missing (a bias) is listed, not refused: the layer's weight was loaded.
    assert torch.equal(loaded["blocks.0.norm.weight"], weights["blocks.0.norm.weight"])


def test_single_file_with_old_mlp_names_reads_as_this_models_names(tmp_path):
    """GPT-NeoX without a pipeline (pipe_parallel_size 0) keeps the module in mp_rank_00_model_states.pt."""
    stored = {
        "sequential.0.word_embeddings.weight": torch.randn(8, 4),
        "sequential.2.mlp.dense_h_to_4h.weight": torch.randn(16, 4),
        "sequential.2.mlp.dense_4h_to_h.bias": torch.randn(4),
        "sequential.2.attention.rotary_emb.inv_freq": torch.ones(2),
        "sequential.2.attention.dense.weight": torch.randn(4, 4),
    }
    tag_dir = tmp_path / "global_step3"
    tag_dir.mkdir()
    torch.save({"module": stored, "iteration": 3}, tag_dir / model_states_name(0))
    read = read_module_weights(tag_dir)
    assert list(read) == ["sequential.0.word_embeddings.weight", "sequential.2.mlp.linear1.weight",
                          "sequential.2.mlp.linear2.bias", "sequential.2.attention.dense.weight"]
    assert torch.equal(read["sequential.2.mlp.linear1.weight"], stored["sequential.2.mlp.dense_h_to_4h.weight"])
    # A full resume restores the module through DeepSpeed, under the stored names: it is checked for them.
    assert legacy_names_in_model_states_file(tag_dir) == [
        "sequential.2.mlp.dense_h_to_4h.weight", "sequential.2.mlp.dense_4h_to_h.bias",
        "sequential.2.attention.rotary_emb.inv_freq"]


@pytest.mark.usefixtures("single_rank_world")
def test_pipeline_layer_files_of_gpt_neox_first_llama_mlp_read_as_linear1_and_linear2(tmp_path):
    args = NeoXArgs.from_dict({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
                               "seq_length": 16, "norm": "rmsnorm", "activation": "swiglu", "pos_emb": "rotary",
                               "use_bias_in_norms": False, "use_bias_in_attn_linear": False, "use_bias_in_mlp": False,
                               "no_weight_tying": True, "train_iters": 1, "embedded_corpus": True,
                               "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
                               "train_micro_batch_size_per_gpu": 1, "padded_vocab_size": 128})
    model = build_model(args.architecture(), 0)
    tag_dir = write_gpt_neox_pipeline_checkpoint(model, tmp_path, rename=old_llama_mlp_names)
    assert "mlp.w3.weight" in torch.load(tag_dir / layer_file_name(2, 0), weights_only=True)
    read = read_module_weights(tag_dir)
    assert list(read) and sorted(read) == sorted(model.state_dict())
    assert all(torch.equal(read[name], tensor) for name, tensor in model.state_dict().items())
