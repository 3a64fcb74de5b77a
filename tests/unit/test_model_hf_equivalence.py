"""Independent oracle: tiny random Hugging Face GPTNeoX / Llama models, weights copied in, same logits.

The mapping here is a small inline one for the test; the full HF interop lives in tools/ckpts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from megatron.checkpointing.formats.legacy_names import translate_legacy_key
from megatron.model import build_model
from tests.unit.test_model import HEAD_DIM, HEADS, HIDDEN, VOCAB, tiny_args, tokens

pytestmark = pytest.mark.usefixtures("single_rank_world")

LAYERS = 2


def randomize_(model: torch.nn.Module) -> None:
    """HF initialises biases to 0 and norms to 1; random values make every term show."""
    gen = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def neox_state_from_hf(hf: GPTNeoXForCausalLM) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in hf.state_dict().items():
        if name.startswith("gpt_neox.layers."):
            index, rest = name[len("gpt_neox.layers.") :].split(".", 1)
            state[translate_legacy_key(f"sequential.{int(index) + 2}.{rest}")] = tensor
        elif name == "gpt_neox.embed_in.weight":
            state["sequential.0.word_embeddings.weight"] = tensor
        elif name.startswith("gpt_neox.final_layer_norm."):
            state[f"sequential.{LAYERS + 3}.norm.{name.rsplit('.', 1)[1]}"] = tensor
        elif name in ("embed_out.weight", "lm_head.weight"):
            state[f"sequential.{LAYERS + 4}.final_linear.weight"] = tensor
        else:
            raise AssertionError(f"unmapped HF key {name}")
    return state


def llama_state_from_hf(hf: LlamaForCausalLM, kv_heads: int, tied: bool) -> dict[str, torch.Tensor]:
    hf_state = hf.state_dict()
    state = {"sequential.0.word_embeddings.weight": hf_state["model.embed_tokens.weight"]}
    for i in range(LAYERS):
        src, dst = f"model.layers.{i}.", f"sequential.{i + 2}."
        q, k, v = (hf_state[f"{src}self_attn.{p}_proj.weight"] for p in "qkv")
        if kv_heads == HEADS:  # per head [q, k, v]
            fused = torch.stack([t.view(HEADS, HEAD_DIM, HIDDEN) for t in (q, k, v)], dim=1)
            fused = fused.reshape(3 * HIDDEN, HIDDEN)
        else:  # all q, all k, all v
            fused = torch.cat([q, k, v])
        state[f"{dst}attention.query_key_value.weight"] = fused
        state[f"{dst}attention.dense.weight"] = hf_state[f"{src}self_attn.o_proj.weight"]
        state[f"{dst}mlp.linear1.weight"] = torch.cat(
            [hf_state[f"{src}mlp.up_proj.weight"], hf_state[f"{src}mlp.gate_proj.weight"]]
        )
        state[f"{dst}mlp.linear2.weight"] = hf_state[f"{src}mlp.down_proj.weight"]
        state[f"{dst}input_layernorm.scale"] = hf_state[f"{src}input_layernorm.weight"]
        state[f"{dst}post_attention_layernorm.scale"] = hf_state[f"{src}post_attention_layernorm.weight"]
    state[f"sequential.{LAYERS + 3}.norm.scale"] = hf_state["model.norm.weight"]
    if not tied:
        state[f"sequential.{LAYERS + 4}.final_linear.weight"] = hf_state["lm_head.weight"]
    return state


def assert_same_logits(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    batch = tokens(batch=2, seq=10, seed=5)
    with torch.no_grad():
        expected = hf(input_ids=batch).logits
        actual = ours.eval()(batch)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def gpt_neox_pair(parallel_residual: bool = True, rotary_pct: float = 0.25):
    """(our GPTModel, HF GPTNeoXForCausalLM) holding the same random weights."""
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN,
        hidden_act="gelu",
        rotary_pct=rotary_pct,
        rotary_emb_base=1000,
        max_position_embeddings=32,
        layer_norm_eps=1e-5,
        use_parallel_residual=parallel_residual,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = GPTNeoXForCausalLM(config).eval()
    randomize_(hf)
    ours = build_model(
        tiny_args(
            pos_emb="rotary",
            rotary_pct=rotary_pct,
            rotary_emb_base=1000,
            gpt_j_residual=parallel_residual,
            no_weight_tying=True,
            norm="layernorm",
            layernorm_epsilon=1e-5,
            activation="gelu",
        ).architecture(),
        seed=1234,
    )
    ours.load_state_dict(neox_state_from_hf(hf), strict=True)
    return ours, hf


@pytest.mark.parametrize("parallel_residual", [True, False], ids=["parallel", "sequential"])
@pytest.mark.parametrize("rotary_pct", [0.25, 1.0])
def test_gpt_neox_logits_equal_hugging_face(parallel_residual, rotary_pct):
    assert_same_logits(*gpt_neox_pair(parallel_residual, rotary_pct))


def llama_pair(kv_heads: int = 2, tied: bool = False):
    """(our GPTModel, HF LlamaForCausalLM) holding the same random weights."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    randomize_(hf)
    ours = build_model(
        tiny_args(
            pos_emb="rotary",
            rotary_pct=1.0,
            rotary_emb_base=50000,
            gpt_j_residual=False,
            no_weight_tying=not tied,
            norm="rmsnorm",
            rms_norm_epsilon=1e-6,
            activation="swiglu",
            intermediate_size=3 * 96,  # GPT-NeoX's rule: 96 per projection, as in the HF config
            num_kv_heads=kv_heads,
            use_bias_in_norms=False,
            use_bias_in_attn_linear=False,
            use_bias_in_mlp=False,
        ).architecture(),
        seed=1234,
    )
    ours.load_state_dict(llama_state_from_hf(hf, kv_heads, tied), strict=True)
    return ours, hf


@pytest.mark.parametrize("kv_heads", [2, HEADS], ids=["gqa", "mha"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_logits_equal_hugging_face(kv_heads, tied):
    assert_same_logits(*llama_pair(kv_heads, tied))
