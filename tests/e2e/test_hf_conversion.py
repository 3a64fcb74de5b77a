"""Hugging Face interop: HF <-> ours is bit-exact, logits agree with transformers, the CLIs work on real folders.

transformers is the independent oracle: tiny randomly initialised GPTNeoXForCausalLM, LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM models are built here (no download) and saved in each on-disk format HF uses.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.hf import HFConversionError, is_hf_model_dir, load_hf_module_weights
from megatron.hf.config import spec_from_hf_config
from megatron.hf.convert import convert_hf_to_neox, convert_neox_to_hf
from megatron.hf.io import iter_hf_tensors
from megatron.hf.mapping import convert_tensors, hf_to_ours, ours_to_hf
from megatron.launch.run_context import resolve_run_settings
from megatron.model import build_model
from megatron.neox_arguments import NeoXArgs
from megatron.tokenizer import build_tokenizer, train_bpe_tokenizer
from tests.ckpt_engines import stored_client_state

REPO = Path(__file__).resolve().parents[2]
VOCAB = 320  # > 258: room for a real byte-level BPE tokenizer
TEXT = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine", "hello world"] * 20

FAMILIES = {
    "neox_parallel": ("gpt_neox", dict(rotary_pct=0.25, use_parallel_residual=True)),
    "neox_sequential_tied": ("gpt_neox", dict(rotary_pct=0.5, use_parallel_residual=False, tie_word_embeddings=True)),
    "llama_gqa": ("llama", dict(num_key_value_heads=2, rope_theta=500000.0)),
    "llama_tied_biases": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    # One key/value head: at tensor-parallel size 2 both ranks hold it.
    "llama_mqa": ("llama", dict(num_key_value_heads=1, attention_bias=True)),
    # The bases fine-tuned today (tests/unit/test_hf_families.py checks each against transformers at length):
    # Llama 3.1+'s RoPE scaling (original length 8, shorter than tokens()'s 16), and the other scalings
    "llama31": ("llama", dict(num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8))),
    "llama_yarn": ("llama", dict(num_key_value_heads=2, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8))),
    "llama_linear": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    # transformers' GPTNeoX takes RoPE scaling too; yarn on a partial rotary (GPT-NeoX itself has no such setting)
    "neox_yarn": ("gpt_neox", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                        original_max_position_embeddings=8, partial_rotary_factor=0.5))),
    # Mistral's window of 6 positions, shorter than tokens()'s 16
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=6)),
    # without a window it computes what a Llama does, and goes back as a Mistral all the same (hf_model_type)
    "mistral_no_window": ("mistral", dict(num_key_value_heads=2, sliding_window=None)),
    # Qwen2.5: biases on q/k/v only, tied embeddings as in its small models, yarn for long context
    "qwen2": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=8))),
    # Qwen3: per-head q/k RMSNorm and heads 32 wide (not 64 / 4)
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=32)),
    # mixtures of experts (tests/unit/test_hf_moe.py checks their gradients against transformers): 4 experts,
    # 2 per token; Mixtral's experts 96 wide, Qwen3-MoE's 32 beside a dense width its layers do not use
    "mixtral": ("mixtral", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                output_router_logits=True, router_aux_loss_coef=0.02)),
    "qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2, norm_topk_prob=True, output_router_logits=True,
                                    router_aux_loss_coef=0.02)),
    "qwen3_moe_unnormalised": ("qwen3_moe", dict(num_key_value_heads=2, moe_intermediate_size=32, num_experts=4,
                                                 num_experts_per_tok=2, norm_topk_prob=False)),
    # Qwen2-MoE: a gated shared expert 48 wide beside experts 32 wide, q/k/v biases, layer 1 dense (mlp_only_layers:
    # experts every 2nd layer from 0), top-k weights not renormalised (its default)
    "qwen2_moe": ("qwen2_moe", dict(num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                    num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                    output_router_logits=True, router_aux_loss_coef=0.02)),
    # OLMoE: q/k RMSNorm across all heads (keys: 2 heads' width), experts 96 wide, biases on every attention
    # projection; no padding token (as the others: transformers never trains a pad_token_id's embedding row)
    "olmoe": ("olmoe", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attention_bias=True,
                            output_router_logits=True, router_aux_loss_coef=0.02, pad_token_id=None)),
}
MOE_KINDS = ("mixtral", "qwen3_moe", "qwen3_moe_unnormalised", "qwen2_moe", "olmoe")


def make_hf_model(kind: str, seed: int = 0):
    """A tiny transformers model of `kind` with every parameter random (norms and biases too)."""
    import transformers

    family, options = FAMILIES[kind]
    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                  max_position_embeddings=64)
    if family == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(intermediate_size=256, **common, **options))
    else:
        name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "mixtral": "Mixtral",
                "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe"}[family]
        config = getattr(transformers, f"{name}Config")(intermediate_size=96, **common, **options)
        model = getattr(transformers, f"{name}ForCausalLM")(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or "norm.weight" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.2)
    return model.eval()


def save_hf(model, path: Path, fmt: str = "safetensors", tokenizer: bool = False) -> Path:
    """Save as HF does: one safetensors file, sharded safetensors + index, or pytorch_model.bin (+ index)."""
    if fmt == "safetensors":
        model.save_pretrained(path)
    elif fmt == "sharded":
        model.save_pretrained(path, max_shard_size="60KB")
        assert (path / "model.safetensors.index.json").is_file()
    else:  # transformers 5 writes no .bin any more; write the format older releases wrote
        path.mkdir(parents=True)
        model.config.save_pretrained(path)
        state = {k: v.clone() for k, v in hf_reference(model).items()}
        if fmt == "bin":
            torch.save(state, path / "pytorch_model.bin")
        else:
            names = sorted(state)
            shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
            for shard, keys in shards.items():
                torch.save({k: state[k] for k in keys}, path / shard)
            index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
            (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    if tokenizer:
        train_bpe_tokenizer(TEXT, path / "tokenizer.json", vocab_size=300, min_frequency=1)
    return path


def hf_reference(model) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of `model` holds, named as save_pretrained names them (transformers' own
    renaming: GPTNeoX's output layer is embed_out, experts fused in memory are stored one by one); a tied output
    layer is not stored."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return revert_weight_conversion(model, state)


def our_args(hf_dir: Path, **overrides) -> NeoXArgs:
    spec = spec_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    return NeoXArgs.from_dict({**spec.settings, "padded_vocab_size": spec.vocab_size, "train_iters": 1,
                               "hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides})


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


def logits_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Our model's logits on CPU, wherever the accelerator put the model."""
    return model(batch.to(next(model.parameters()).device)).cpu()


def run_tool(script: str, *arguments: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "tools" / "ckpts" / script), *arguments],
                          capture_output=True, text=True, env=env, timeout=300)


def call_tool(script: str, *arguments: str) -> subprocess.CompletedProcess:
    """The tool's main() in this process, its exit status and output as run_tool reports them. For the cases of a
    tool that vary its inputs: each tool also runs as a real process in one case (run_tool), and a process of
    its own costs ~10 s of imports on 2 cores."""
    spec = importlib.util.spec_from_file_location(f"tool_{Path(script).stem}", REPO / "tools" / "ckpts" / script)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = tool.main(list(arguments))
        except SystemExit as exit_:
            status = exit_.code
    return subprocess.CompletedProcess([script, *arguments], status, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_hf_to_ours_to_hf_is_bit_exact(kind):
    model = make_hf_model(kind)
    spec = spec_from_hf_config(model.config.to_dict())
    arch = spec.architecture()
    reference = hf_reference(model)
    ours = convert_tensors(reference.items(), hf_to_ours(spec.family, arch), "test")
    back = convert_tensors(ours.items(), ours_to_hf(spec.family, arch), "test")
    assert sorted(back) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_our_logits_equal_hf_logits_after_direct_load(kind, tmp_path):
    model = make_hf_model(kind)
    hf_dir = save_hf(model, tmp_path / "hf")
    args = our_args(hf_dir)
    ours = build_model(args.architecture(), args.seed).eval()
    ours.load_state_dict(load_hf_module_weights(hf_dir, args.architecture()), strict=True)
    with torch.no_grad():
        expected = model(tokens()).logits
        actual = logits_of(ours, tokens())
    assert expected.abs().max() > 1  # random weights of this size give logits far from zero
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


@pytest.mark.usefixtures("single_rank_world")
def test_fused_qkv_layout_is_what_the_logits_check_catches(tmp_path):
    """Feed Llama-GQA weights through the per-head layout rule instead: the logits must then differ."""
    model = make_hf_model("llama_gqa")
    hf_dir = save_hf(model, tmp_path / "hf")
    args = our_args(hf_dir)
    weights = load_hf_module_weights(hf_dir, args.architecture())
    key = "sequential.2.attention.query_key_value.weight"
    q, k, v = weights[key].split([64, 32, 32])
    weights[key] = torch.cat([q, v, k])
    ours = build_model(args.architecture(), args.seed).eval()
    ours.load_state_dict(weights)
    with torch.no_grad():
        assert not torch.allclose(logits_of(ours, tokens()), model(tokens()).logits, atol=1e-3)


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin", "bin_sharded"])
def test_every_hf_weight_format_reads_the_same_tensors(fmt, tmp_path):
    model = make_hf_model("neox_parallel")
    hf_dir = save_hf(model, tmp_path / fmt, fmt)
    assert is_hf_model_dir(hf_dir)
    read = dict(iter_hf_tensors(hf_dir))
    reference = hf_reference(model)
    assert sorted(read) == sorted(reference)
    assert all(torch.equal(read[k], reference[k]) for k in reference)


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin"])
@pytest.mark.slow
def test_convert_hf_to_neox_cli_writes_a_module_only_checkpoint(fmt, tmp_path):
    model = make_hf_model("llama_gqa")
    hf_dir = save_hf(model, tmp_path / "hf", fmt, tokenizer=True)
    out, yml = tmp_path / "ckpt", tmp_path / "model.yml"
    tool = run_tool if fmt == "safetensors" else call_tool  # the formats differ in the files read, not the CLI
    result = tool("convert_hf_to_neox.py", "--input", str(hf_dir), "--output", str(out), "--config-out", str(yml))
    assert result.returncode == 0, result.stderr
    assert (out / "latest").read_text() == "global_step0"
    tag_dir = out / "global_step0"
    # no optimizer files; the manifest of a tag committed as a save is
    assert sorted(p.name for p in tag_dir.iterdir()) == ["manifest.json", "mp_rank_00_model_states.pt"]
    client = stored_client_state(tag_dir)
    assert client["iteration"] == 0 and client["args"]["padded_vocab_size"] == VOCAB
    spec = spec_from_hf_config(model.config.to_dict())
    expected = convert_tensors(hf_reference(model).items(), hf_to_ours(spec.family, spec.architecture()), "test")
    weights = read_module_weights(tag_dir)
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert (out / "tokenizer.json").is_file()


def test_config_out_is_a_config_fragment_that_reproduces_the_model(tmp_path):
    """The YAML plus a training fragment loads, its tokenizer pads to HF's vocab_size, and the HF check passes."""
    model = make_hf_model("neox_parallel")
    hf_dir = save_hf(model, tmp_path / "hf", tokenizer=True)
    yml = tmp_path / "model.yml"
    convert_hf_to_neox(hf_dir, tmp_path / "ckpt", "fp32", yml)
    training = tmp_path / "train.yml"
    training.write_text("train_iters: 10\ntrain_micro_batch_size_per_gpu: 1\nseq_length: 16\nlr: 0.001\ndata_path: corpus/text_document\n")
    args = NeoXArgs.from_yaml_files([yml, training])
    assert build_tokenizer(args).vocab_size < VOCAB
    args = resolve_run_settings(args)  # padded_vocab_size from the tokenizer, as deepy.py does before the ranks start
    assert args.padded_vocab_size == VOCAB
    weights = load_hf_module_weights(hf_dir, args.architecture())  # raises on any setting that disagrees with config.json
    assert weights["sequential.0.word_embeddings.weight"].shape == (VOCAB, 64)


@pytest.mark.usefixtures("single_rank_world")
def test_settings_that_disagree_with_config_json_are_an_error_naming_both_values(tmp_path):
    hf_dir = save_hf(make_hf_model("llama_gqa"), tmp_path / "hf")
    args = our_args(hf_dir, num_kv_heads=4, rms_norm_epsilon=1e-5)
    with pytest.raises(HFConversionError) as caught:
        load_hf_module_weights(hf_dir, args.architecture())
    message = str(caught.value)
    assert "num_kv_heads: config.json says 2, the settings say 4" in message
    assert "norm_epsilon: config.json says 1e-06, the settings say 1e-05 (set by layernorm_epsilon or rms_norm_epsilon)" in message
    args = our_args(hf_dir, padded_vocab_size=512)
    with pytest.raises(HFConversionError, match="vocab_size: config.json says 320, the settings say 512 .*padded_vocab_size"):
        load_hf_module_weights(hf_dir, args.architecture())


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
        (dict(rope_parameters={"rope_type": "longrope", "factor": 2.0, "rope_theta": 10000.0}), "rope_type 'longrope'"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic' .* not supported for training"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}),
         "low_freq_factor, high_freq_factor, original_max_position_embeddings missing"),
        (dict(hidden_act="gelu_10"), "hidden_act 'gelu_10'"),
    ],
)
@pytest.mark.slow
def test_unsupported_architectures_are_refused(change, expected, tmp_path):
    hf_dir = save_hf(make_hf_model("neox_parallel"), tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(HFConversionError, match=expected):
        convert_hf_to_neox(hf_dir, tmp_path / "out")
    result = run_tool("convert_hf_to_neox.py", "--input", str(hf_dir), "--output", str(tmp_path / "cli")) \
        if change.get("model_type") else None
    if result is not None:
        assert result.returncode == 1 and "not supported" in result.stderr


@pytest.mark.parametrize("kind", ["neox_parallel", "llama_gqa"])
def test_transformers_4_config_layout_translates_the_same(kind):
    """Pythia and Llama-2 config.json files name rotary settings at the top level, with rope_scaling: null."""
    config = make_hf_model(kind).config.to_dict()
    rope = config.pop("rope_parameters")
    if config["model_type"] == "gpt_neox":
        old = {"rotary_pct": rope["partial_rotary_factor"], "rotary_emb_base": int(rope["rope_theta"])}
    else:
        old = {"rope_theta": rope["rope_theta"]}
    translated = spec_from_hf_config({**config, **old, "rope_scaling": None})
    assert translated == spec_from_hf_config(make_hf_model(kind).config.to_dict())
    assert translated.settings["rotary_emb_base"] == int(rope["rope_theta"])


def test_llama_like_options_we_cannot_represent_are_refused():
    for kind, change, expected in (
            ("llama_gqa", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
            ("llama_gqa", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
            ("qwen2", dict(use_sliding_window=True), "a window on some layers only is not supported"),
            ("qwen3", dict(layer_types=["sliding_attention", "full_attention"]), "a window on some layers only")):
        with pytest.raises(HFConversionError, match=expected):
            spec_from_hf_config({**make_hf_model(kind).config.to_dict(), **change})


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path):
    model = make_hf_model("neox_parallel")
    hf_dir = save_hf(model, tmp_path / "hf", "bin")
    state = torch.load(hf_dir / "pytorch_model.bin")
    del state["gpt_neox.layers.1.mlp.dense_4h_to_h.bias"]
    state["gpt_neox.layers.2.mlp.dense_4h_to_h.bias"] = torch.zeros(64)
    torch.save(state, hf_dir / "pytorch_model.bin")
    with pytest.raises(HFConversionError, match=r"missing gpt_neox\.layers\.1\.mlp\.dense_4h_to_h\.bias, "
                                                r"unexpected gpt_neox\.layers\.2\.mlp\.dense_4h_to_h\.bias"):
        convert_hf_to_neox(hf_dir, tmp_path / "out")


@pytest.mark.parametrize("kind", ["neox_parallel", "llama_gqa", "llama_tied_biases", "llama31", "mistral",
                                  "mistral_no_window", "qwen2", "qwen3", *MOE_KINDS])
def test_hf_to_ours_to_hf_folders_are_bit_exact_and_load_in_transformers(kind, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = make_hf_model(kind)
    hf_dir = save_hf(model, tmp_path / "hf", tokenizer=True)
    convert_hf_to_neox(hf_dir, tmp_path / "ckpt")
    convert_neox_to_hf(tmp_path / "ckpt", tmp_path / "back")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "back")
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token == "<|padding|>"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert reloaded.config.eos_token_id == tokenizer.eos_token_id == 0
    assert type(reloaded) is type(model)
    for key in ("model_type", "rope_parameters", "head_dim", "sliding_window", "attention_bias", "num_key_value_heads",
                "intermediate_size", "moe_intermediate_size", "num_local_experts", "num_experts_per_tok",
                "norm_topk_prob", "output_router_logits", "router_aux_loss_coef", "num_experts",
                "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "clip_qkv"):
        assert getattr(reloaded.config, key, None) == getattr(model.config, key, None), key
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens()).logits, model(tokens()).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_convert_neox_to_hf_cli_in_bf16_sharded(tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_hf_model("neox_sequential_tied")
    hf_dir = save_hf(model, tmp_path / "hf")
    convert_hf_to_neox(hf_dir, tmp_path / "ckpt")
    result = run_tool("convert_neox_to_hf.py", "--input", str(tmp_path / "ckpt"), "--tag", "global_step0",
                      "--output", str(tmp_path / "back"), "--dtype", "bf16", "--max-shard-size", "40KB")
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert reloaded.config.tie_word_embeddings and reloaded.dtype == torch.bfloat16
    for name, tensor in hf_reference(model).items():
        assert torch.equal(reloaded.state_dict()[name], tensor.to(torch.bfloat16)), name


def convert_neox_to_hf_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_neox_to_hf_tool", REPO / "tools/ckpts/convert_neox_to_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize("kind, gpt_neox_flags", [
    ("neox_parallel", ["--precision", "auto", "--architecture", "neox", "--no_save_tokenizer"]),
    ("llama_gqa", ["--precision", "bf16", "--vocab-is-hf-tokenizer", "--architecture", "llama", "--pad-token-id", "5"]),
])
def test_convert_neox_to_hf_takes_gpt_neox_command_line(kind, gpt_neox_flags, tmp_path):
    """GPT-NeoX's README command: --input_dir <tag> --config_file <tag>/configs/neox_config.yml --output_dir ..."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron.checkpointing.saving.neox_config import write_neox_config

    model = make_hf_model(kind)
    tag_dir = convert_hf_to_neox(save_hf(model, tmp_path / "hf", tokenizer=True), tmp_path / "ckpt").tag_dir
    config_file = write_neox_config(stored_client_state(tag_dir)["args"], tag_dir / "configs" / "neox_config.yml")
    tool = convert_neox_to_hf_tool()
    argv = ["--input_dir", str(tag_dir), "--config_file", str(config_file), "--output_dir", str(tmp_path / "back"),
            *gpt_neox_flags]
    assert tool.main(argv) == 0
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    dtype = torch.bfloat16 if "bf16" in gpt_neox_flags else torch.float32
    assert type(reloaded) is type(model) and reloaded.dtype == dtype
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor.to(dtype)), name
    if "--no_save_tokenizer" in gpt_neox_flags:
        assert not (tmp_path / "back" / "tokenizer.json").exists()
    else:
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / "back")
        assert tokenizer.pad_token_id == reloaded.config.pad_token_id == 5


def test_writing_a_model_as_the_wrong_family_is_refused(tmp_path):
    hf_dir = save_hf(make_hf_model("llama_gqa"), tmp_path / "hf")
    convert_hf_to_neox(hf_dir, tmp_path / "ckpt")
    with pytest.raises(HFConversionError, match="cannot be written as Hugging Face gpt_neox: .*num_kv_heads=2"):
        convert_neox_to_hf(tmp_path / "ckpt", tmp_path / "back", architecture="gpt_neox")


def write_pipeline_checkpoint(module: dict[str, torch.Tensor], root: Path, legacy_mlp_names: bool) -> Path:
    """GPT-NeoX's pipeline layout: one layer_<II>-model_00-model_states.pt per sequential index, no settings."""
    tag_dir = root / "global_step7"
    tag_dir.mkdir(parents=True)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in module.items():
        _, index, rest = name.split(".", 2)
        if legacy_mlp_names:
            rest = rest.replace("mlp.linear1.", "mlp.dense_h_to_4h.").replace("mlp.linear2.", "mlp.dense_4h_to_h.")
        layers.setdefault(int(index), {})[rest] = tensor
    for index, state in layers.items():
        if legacy_mlp_names and "attention.dense.weight" in state:  # GPT-NeoX stored this buffer
            state["attention.rotary_emb.inv_freq"] = torch.ones(4)
        torch.save(state, tag_dir / f"layer_{index:02d}-model_00-model_states.pt")
    (root / "latest").write_text("global_step7")
    return tag_dir


@pytest.mark.parametrize("legacy_mlp_names", [False, True])
@pytest.mark.slow
def test_gpt_neox_pipeline_checkpoint_converts_with_a_config_yaml(legacy_mlp_names, tmp_path):
    model = make_hf_model("neox_parallel")
    hf_dir = save_hf(model, tmp_path / "hf")
    yml = tmp_path / "model.yml"
    convert_hf_to_neox(hf_dir, tmp_path / "ckpt", config_out=yml)
    module = read_module_weights(tmp_path / "ckpt" / "global_step0")
    write_pipeline_checkpoint(module, tmp_path / "pipe", legacy_mlp_names)
    tool = call_tool if legacy_mlp_names else run_tool  # the two differ in the names read, not the CLI
    result = tool("convert_neox_to_hf.py", "--input", str(tmp_path / "pipe"), "--output", str(tmp_path / "back"),
                  "--config", str(yml))
    assert result.returncode == 0, result.stderr
    back, original = load_file(tmp_path / "back" / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_pipeline_checkpoint_without_settings_asks_for_a_config(tmp_path):
    hf_dir = save_hf(make_hf_model("neox_parallel"), tmp_path / "hf")
    convert_hf_to_neox(hf_dir, tmp_path / "ckpt")
    write_pipeline_checkpoint(read_module_weights(tmp_path / "ckpt" / "global_step0"), tmp_path / "pipe", False)
    with pytest.raises(HFConversionError, match="pass the run's YAML files with --config"):
        convert_neox_to_hf(tmp_path / "pipe", tmp_path / "back")


@pytest.mark.parametrize("kind", ["neox_parallel", "llama_gqa", "llama_mqa", "qwen3"])
@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_exports_to_hf_with_the_same_weights_and_logits(kind, tmp_path):
    """HF -> ours split for 2 tensor-parallel ranks (the CLI's --model-parallel-size) -> HF: every tensor
    comes back bit for bit, and transformers computes the same logits from it."""
    from transformers import AutoModelForCausalLM

    model = make_hf_model(kind)
    hf_dir = save_hf(model, tmp_path / "hf")
    tool = run_tool if kind == "neox_parallel" else call_tool  # the families differ in the split, not the CLI
    result = tool("convert_hf_to_neox.py", "--input", str(hf_dir), "--output", str(tmp_path / "ckpt"),
                  "--model-parallel-size", "2")
    assert result.returncode == 0, result.stderr
    tag_dir = tmp_path / "ckpt" / "global_step0"
    halves = [read_module_weights(tag_dir, mp) for mp in (0, 1)]
    qkv = "sequential.2.attention.query_key_value.weight"
    # rows per rank: 2 of the 4 query heads, then its key and value heads (16 wide, Qwen3's 32)
    kv_heads_per_rank = {"neox_parallel": 2, "llama_gqa": 1, "llama_mqa": 1, "qwen3": 1}[kind]
    head_dim = 32 if kind == "qwen3" else 16
    assert halves[0][qkv].shape == halves[1][qkv].shape == ((2 + 2 * kv_heads_per_rank) * head_dim, 64)
    assert not torch.equal(halves[0][qkv], halves[1][qkv])
    if kind == "llama_mqa":  # each rank holds the one key and value head, as transformers has them
        attention = model.model.layers[0].self_attn
        for half in halves:
            for name, kv_bias in ((qkv, False), (qkv.replace("weight", "bias"), True)):
                key, value = half[name][2 * 16:3 * 16], half[name][3 * 16:]
                k_proj, v_proj = attention.k_proj, attention.v_proj
                assert torch.equal(key, (k_proj.bias if kv_bias else k_proj.weight).detach())
                assert torch.equal(value, (v_proj.bias if kv_bias else v_proj.weight).detach())
    convert_neox_to_hf(tmp_path / "ckpt", tmp_path / "back")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens()).logits, model(tokens()).logits, rtol=0, atol=0)


@pytest.mark.parametrize("pipe_parallel_size", [1, 2])
def test_convert_hf_to_neox_writes_gpt_neox_layer_files_for_a_pipeline_that_convert_back_bit_for_bit(
        pipe_parallel_size, tmp_path):
    """--pipe-parallel-size P >= 1 (GPT-NeoX's meaning) with 2 tensor-parallel ranks: one layer file per GPT-NeoX
    position and rank holding that rank's slices, P x 2 mp_rank files with the client state only, and
    convert_neox_to_hf.py reads them back into the very HF tensors."""
    model = make_hf_model("neox_parallel")
    hf_dir = save_hf(model, tmp_path / "hf")
    result = call_tool("convert_hf_to_neox.py", "--input", str(hf_dir), "--output", str(tmp_path / "ckpt"),
                       "--model-parallel-size", "2", "--pipe-parallel-size", str(pipe_parallel_size))
    assert result.returncode == 0, result.stderr
    tag_dir = tmp_path / "ckpt" / "global_step0"
    layers = model.config.num_hidden_layers
    positions = [0, *range(2, layers + 2), layers + 3, layers + 4]
    expected_files = {f"layer_{i:02d}-model_{mp:02d}-model_states.pt" for i in positions for mp in (0, 1)}
    expected_files |= {f"mp_rank_{rank:02d}_model_states.pt" for rank in range(2 * pipe_parallel_size)}
    assert {p.name for p in tag_dir.iterdir()} == expected_files | {"manifest.json"}
    assert all(torch.load(tag_dir / f"mp_rank_{rank:02d}_model_states.pt", weights_only=True)["module"] is None
               for rank in range(2 * pipe_parallel_size))
    convert_hf_to_neox(hf_dir, tmp_path / "plain", model_parallel_size=2)
    for mp in (0, 1):
        plain, layered = read_module_weights(tmp_path / "plain" / "global_step0", mp), read_module_weights(tag_dir, mp)
        assert sorted(layered) == sorted(plain)
        assert all(torch.equal(layered[k], plain[k]) for k in plain)
    convert_neox_to_hf(tmp_path / "ckpt", tmp_path / "back")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
