"""The one architecture contract: GPT-NeoX's shape rules, and one field list refusing every load that differs."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk.client_state import FORMAT_VERSION, FORMAT_VERSION_KEY
from megatron.checkpointing.ondisk.inventory import inventory_checkpoint
from megatron.checkpointing.planning.plan import build_load_plan
from megatron.contract.architecture import FIELDS_THAT_REFUSE_A_LOAD
from megatron.hf import HF_FOLDER
from megatron.model import GPTModel, build_model
from megatron.neox_arguments import NeoXArgs

# --- GPT-NeoX's MLP rule -------------------------------------------------------------------

# A Llama-style model as a GPT-NeoX user writes it (GPT-NeoX's keys, dashes included).
GPT_NEOX_LLAMA_STYLE = """
{
  "num-layers": 2,
  "hidden-size": 64,
  "num-attention-heads": 4,
  "num-kv-heads": 2,
  "intermediate_size": 512,
  "mlp_multiple_of": 16,
  "seq-length": 32,
  "max-position-embeddings": 32,
  "pos-emb": "rotary",
  "rotary-pct": 1,
  "no-weight-tying": true,
  "gpt-j-residual": false,
  "norm": "rmsnorm",
  "rms-norm-epsilon": 1.0e-6,
  "activation": "swiglu",
  "use-bias-in-norms": false,
  "use-bias-in-attn-linear": false,
  "use_bias_in_mlp": false,
  "scaled-upper-triang-masked-softmax-fusion": true,
  "bias-gelu-fusion": false,
}
"""


@pytest.mark.usefixtures("single_rank_world")
def test_gpt_neox_llama_style_config_builds_the_shapes_gpt_neox_builds(tmp_path):
    config = tmp_path / "llama-style.yml"
    config.write_text(GPT_NEOX_LLAMA_STYLE)
    args = NeoXArgs.from_dict({**yaml.safe_load(config.read_text()), "padded_vocab_size": 128}, source=str(config))
    shapes = {name: tuple(p.shape) for name, p in build_model(args.architecture(), 0).named_parameters()}
    # int(512 * 2 / 3) = 341 -> up to a multiple of 2 x 16: 352 for gate + up; 341 // 2 = 170 -> up to 16: 176
    layer = {
        "input_layernorm.scale": (64,),
        "attention.query_key_value.weight": (64 + 2 * 2 * 16, 64),  # 4 query heads + 2 key + 2 value, 16 wide
        "attention.dense.weight": (64, 64),
        "post_attention_layernorm.scale": (64,),
        "mlp.linear1.weight": (352, 64),
        "mlp.linear2.weight": (64, 176),
    }
    expected = {"sequential.0.word_embeddings.weight": (128, 64), "sequential.5.norm.scale": (64,),
                "sequential.6.final_linear.weight": (128, 64)}
    for index in (2, 3):
        expected.update({f"sequential.{index}.{name}": shape for name, shape in layer.items()})
    assert shapes == expected


@pytest.mark.usefixtures("single_rank_world")
def test_llama_7b_config_has_llamas_published_shape():
    """GPT-NeoX's llama/7B.yml sizes: 11008 per MLP projection and Llama-7B's 6,738,415,616 parameters."""
    settings = dict(num_layers=32, hidden_size=4096, intermediate_size=32768, num_attention_heads=32, seq_length=2048,
                    max_position_embeddings=2048, pos_emb="rotary", rotary_pct=1, no_weight_tying=True,
                    gpt_j_residual=False, norm="rmsnorm", rms_norm_epsilon=1.0e-6, use_bias_in_mlp=False,
                    use_bias_in_norms=False, use_bias_in_attn_linear=False, activation="swiglu", mlp_multiple_of=256,
                    make_vocab_size_divisible_by=1, padded_vocab_size=32000)
    arch = NeoXArgs.from_dict(settings).architecture()
    assert arch.intermediate_size == 11008
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = GPTModel(arch)
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.parametrize(("settings", "reference"), [
    ({}, lambda x: x * 0.5 * (1 + torch.erf(x / 2**0.5))),
    ({"bias_gelu_fusion": True}, lambda x: 0.5 * x * (1 + torch.tanh((2 / math.pi) ** 0.5 * (x + 0.044715 * x**3)))),
    ({"onnx_safe": True}, lambda x: x * 0.5 * (torch.erf(x / 1.41421) + 1)),
], ids=["exact", "bias_gelu_fusion-tanh", "onnx_safe-erf"])
def test_gelu_is_the_one_gpt_neox_computes_for_these_settings(settings, reference):
    args = NeoXArgs.from_dict(dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                                   padded_vocab_size=32, **settings))
    mlp = build_model(args.architecture(), seed=0).layers[0].mlp
    x = torch.linspace(-4, 4, 1001, dtype=torch.float64)  # in float64 the variants differ far above rounding
    torch.testing.assert_close(mlp.activation(x), reference(x), rtol=0, atol=1e-12)
    if settings:
        assert (mlp.activation(x) - torch.nn.functional.gelu(x)).abs().max() > 1e-7


# --- one field list refuses a load, for our checkpoints and Hugging Face folders alike -----

# A tiny GPT-NeoX/Pythia-style model, spelled once in our settings and once as an HF config.json.
OURS = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=32, max_position_embeddings=32,
            intermediate_size=64, padded_vocab_size=32, pos_emb="rotary", rotary_pct=0.25, rotary_emb_base=10000,
            norm="layernorm", layernorm_epsilon=1e-5, activation="gelu", gpt_j_residual=True, no_weight_tying=True,
            use_bias_in_norms=True, use_bias_in_attn_linear=True, use_bias_in_mlp=True, hidden_dropout=0.0,
            attention_dropout=0.0)
HF_CONFIG = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "partial_rotary_factor": 0.25},
                 layer_norm_eps=1e-5, hidden_act="gelu", use_parallel_residual=True, tie_word_embeddings=False)

# field -> (the setting changed, its new value, the field's value in the checkpoint, the field's value now)
CHANGES = {
    "num_layers": ("num_layers", 3, 2, 3),
    "hidden_size": ("hidden_size", 32, 16, 32),
    "num_attention_heads": ("num_attention_heads", 1, 2, 1),
    "num_kv_heads": ("num_kv_heads", 1, 2, 1),
    "intermediate_size": ("intermediate_size", 128, 64, 128),
    "vocab_size": ("padded_vocab_size", 64, 32, 64),
    "pos_emb": ("pos_emb", "learned", "rotary", "learned"),
    "rotary_pct": ("rotary_pct", 0.5, 0.25, 0.5),
    "rotary_emb_base": ("rotary_emb_base", 500000, 10000.0, 500000.0),
    "norm": ("norm", "rmsnorm", "layernorm", "rmsnorm"),
    "norm_epsilon": ("layernorm_epsilon", 1e-6, 1e-5, 1e-6),
    "activation": ("activation", "relu", "gelu", "relu"),
    "gelu_approximation": ("bias_gelu_fusion", True, "none", "tanh"),
    "bias_in_norms": ("use_bias_in_norms", False, True, False),
    "bias_in_attn_linear": ("use_bias_in_attn_linear", False, True, False),
    "bias_in_mlp": ("use_bias_in_mlp", False, True, False),
    "tied_embeddings": ("no_weight_tying", False, False, True),
    "parallel_residual": ("gpt_j_residual", False, True, False),
    "sliding_window_width": ("sliding_window_width", 16, None, 16),
    "kv_channels": ("kv_channels", 16, 8, 16),
    "qk_layernorm": ("qk_layernorm", True, False, True),
    "qk_layernorm_across_heads": ("qk_layernorm_across_heads", True, False, True),
    "add_qkv_bias": ("add_qkv_bias", True, False, True),
    "rope_scaling": ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, None, {"rope_type": "linear", "factor": 2.0}),
}
# Only with learned position embeddings do weights depend on it; neither HF family has them.
LEARNED = dict(OURS, pos_emb="learned")
NATIVE_ONLY = {"max_position_embeddings": ("max_position_embeddings", 64, 32, 64)}


# The same model with experts in every layer (as wide as intermediate_size: GPT-NeoX's rule for experts), and
# the fields compared only with experts
EXPERTS = dict(OURS, use_bias_in_mlp=False, moe_num_experts=4, moe_top_k=2, moe_router_type="topk")
EXPERT_CHANGES = {
    "moe_num_experts": ("moe_num_experts", 8, 4, 8),
    "moe_top_k": ("moe_top_k", 1, 2, 1),
    "moe_expert_interval": ("moe_expert_interval", 2, 1, 2),
    "moe_intermediate_size": ("moe_intermediate_size", 32, 64, 32),
    "moe_norm_topk_prob": ("moe_norm_topk_prob", True, False, True),
    "moe_router_type": ("moe_router_type", "sinkhorn", "topk", "sinkhorn"),
    "moe_shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size", 32, 0, 32),
}


def test_every_field_of_the_list_is_checked_here():
    assert set(CHANGES) | set(NATIVE_ONLY) | set(EXPERT_CHANGES) == set(FIELDS_THAT_REFUSE_A_LOAD)


def _save_native(root, settings):
    """A checkpoint of ours as save_checkpoint lays it out: the weights plus the run's settings."""
    args = NeoXArgs.from_dict(settings)
    model = build_model(args.architecture(), 0)
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"module": model.state_dict(), "iteration": 1, "args": args.to_dict(),
                FORMAT_VERSION_KEY: FORMAT_VERSION}, tag / "mp_rank_00_model_states.pt")
    (root / "latest").write_text("global_step1")
    return root


@pytest.fixture(scope="module")
def sources(single_rank_world, tmp_path_factory):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    base = tmp_path_factory.mktemp("sources")
    GPTNeoXForCausalLM(GPTNeoXConfig(**HF_CONFIG)).save_pretrained(base / "hf")
    return {"native": _save_native(base / "native", OURS), "learned": _save_native(base / "learned", LEARNED),
            "hf": base / "hf", "experts": _save_native(base / "experts", EXPERTS)}


def _plan(load, settings):
    args = NeoXArgs.from_dict({**settings, "load": str(load), "finetune": True})
    return build_load_plan(args, inventory_checkpoint(load, HF_FOLDER), 1)


def test_the_unchanged_settings_load_from_both(sources):
    assert _plan(sources["native"], OURS).module_only
    assert _plan(sources["hf"], OURS).source_format == "hf"


@pytest.mark.parametrize("source", ["native", "hf"])
@pytest.mark.parametrize("field", sorted(CHANGES))
def test_each_differing_field_refuses_the_load_naming_it_and_both_values(sources, source, field):
    setting, value, theirs, ours = CHANGES[field]
    with pytest.raises(CheckpointError) as refusal:
        _plan(sources[source], {**OURS, setting: value})
    message = str(refusal.value)
    assert f"{field}: " in message and repr(theirs) in message and repr(ours) in message, message


@pytest.mark.parametrize("field", sorted(EXPERT_CHANGES))
def test_each_differing_expert_field_refuses_the_load_naming_it_and_both_values(sources, field):
    setting, value, theirs, ours = EXPERT_CHANGES[field]
    with pytest.raises(CheckpointError) as refusal:
        _plan(sources["experts"], {**EXPERTS, setting: value})
    message = str(refusal.value)
    assert f"{field}: " in message and repr(theirs) in message and repr(ours) in message, message


def test_experts_refuse_a_dense_checkpoint_and_the_load_balancing_loss_refuses_nothing(sources):
    for dense in ("native", "hf"):
        with pytest.raises(CheckpointError, match="moe_num_experts: (saved|config.json says) 1, (now|the settings say) 4"):
            _plan(sources[dense], EXPERTS)
    balanced = dict(EXPERTS, moe_load_balancing_loss=True, moe_load_balancing_loss_coef=0.02)
    assert _plan(sources["experts"], balanced).module_only


def test_max_positions_refuse_only_where_weights_depend_on_them(sources):
    setting, value, theirs, ours = NATIVE_ONLY["max_position_embeddings"]
    with pytest.raises(CheckpointError, match=f"max_position_embeddings: saved {theirs}, now {ours}"):
        _plan(sources["learned"], {**LEARNED, setting: value})
    assert _plan(sources["native"], {**OURS, setting: value}).module_only  # rotary: no weight depends on it


def test_settings_saved_by_another_program_are_compared_on_what_is_there(sources, tmp_path):
    partial = {"num_layers": 2, "hidden_size": 16, "rotary_emb_base": 10000}  # e.g. an older GPT-NeoX's saved args
    tag = tmp_path / "global_step5"
    tag.mkdir()
    module = torch.load(sources["native"] / "global_step1" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    torch.save({"module": module, "iteration": 5, "args": partial}, tag / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step5")
    assert _plan(tmp_path, OURS).module_only
    with pytest.raises(CheckpointError, match="rotary_emb_base: saved 10000.0, now 500000.0"):
        _plan(tmp_path, {**OURS, "rotary_emb_base": 500000})


def test_our_format_1_checkpoints_meant_the_width_per_projection(tmp_path, single_rank_world):
    """Before format 2, a saved intermediate_size was the width per projection as built."""
    llama = dict(OURS, norm="rmsnorm", activation="swiglu", use_bias_in_norms=False, intermediate_size=3 * 40)
    root = _save_native(tmp_path, llama)
    state_file = root / "global_step1" / "mp_rank_00_model_states.pt"
    state = torch.load(state_file, weights_only=False)
    state.update({FORMAT_VERSION_KEY: 1, "args": {**state["args"], "intermediate_size": 40, "mlp_multiple_of": 256}})
    torch.save(state, state_file)
    assert _plan(root, llama).module_only
    with pytest.raises(CheckpointError, match="intermediate_size: saved 40, now 48"):
        _plan(root, {**llama, "intermediate_size": 3 * 48})
