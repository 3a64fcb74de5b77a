"""Translation between a Hugging Face config.json and our settings.

Supported: GPTNeoXForCausalLM (``model_type: gpt_neox``, Pythia) and the Llama-like families, all
options of our one architecture: LlamaForCausalLM (``llama``: every rope_type of
``ROPE_SCALING_KEYS``), MistralForCausalLM (``mistral``: its sliding window), Qwen2ForCausalLM
(``qwen2``: biases on q/k/v only) and Qwen3ForCausalLM (``qwen3``: per-head q/k RMSNorm, a head width
apart from hidden_size / heads), and the mixtures of experts MixtralForCausalLM (``mixtral``: Mistral's
attention, experts renormalising their top-k weights), Qwen2MoeForCausalLM (``qwen2_moe``: biases on q/k/v as
its ``qkv_bias`` says, a gated shared expert beside the routed ones), Qwen3MoeForCausalLM (``qwen3_moe``:
Qwen3's attention) and OlmoeForCausalLM (``olmoe``: q/k RMSNorm across all heads, biases on every attention
projection or none), ``norm_topk_prob`` as the config says. Mixtral and OLMoE have experts in every layer; the
Qwen families where ``decoder_sparse_step`` and ``mlp_only_layers`` leave experts (layer i when (i + 1) %
decoder_sparse_step == 0 and i is not in mlp_only_layers), which must be GPT-NeoX's layers i % moe_expert_interval
== 0 for some interval. Anything either side cannot represent exactly is refused, because a
conversion that silently changes the architecture produces a model that loads but is wrong.

Transformers' sliding window W lets a query see the keys less than W positions back; GPT-NeoX's
sliding_window_width w, those at most w back: W = w + 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.contract.architecture import GELU_EXACT, GELU_TANH, Architecture, ModelConfigError
from megatron.hf.errors import HFConversionError
from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.errors import ConfigError

FAMILIES = ("gpt_neox", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
LLAMA_LIKE = FAMILIES[1:]  # model.layers.<i>.self_attn.q_proj, ...
MIXTURES_OF_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
SOME_LAYERS_DENSE = ("qwen2_moe", "qwen3_moe")  # decoder_sparse_step, mlp_only_layers; the others: every layer
PER_HEAD_QK_NORM = ("qwen3", "qwen3_moe")
HF_CLASS_NAMES = {"gpt_neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
# transformers' defaults for the keys of the mixture-of-experts families an older config.json may lack
HF_MOE_DEFAULTS = {"output_router_logits": False, "router_aux_loss_coef": 0.001, "norm_topk_prob": False}
HF_FAMILY_MOE_DEFAULTS = {"olmoe": {"router_aux_loss_coef": 0.01}}
# A reward model (train_impl rm) is written as, and read from, the family's one-label sequence classifier:
# its `score` is our rm_linear, read by transformers at the last token that is not padding.
REWARD_MODEL_SUFFIX = "ForSequenceClassification"


def hf_class_name(family: str, reward_model: bool) -> str:
    name = HF_CLASS_NAMES[family]
    return name.replace("ForCausalLM", REWARD_MODEL_SUFFIX) if reward_model else name


def is_reward_model_config(hf: dict[str, Any]) -> bool:
    return any(str(name).endswith(REWARD_MODEL_SUFFIX) for name in hf.get("architectures") or ())
# HF hidden_act -> our (activation, bias_gelu_fusion); each computes the same function as ours
GPT_NEOX_ACTIVATIONS = {
    "gelu": ("gelu", False),
    "gelu_pytorch_tanh": ("gelu", True),
    "gelu_new": ("gelu", True),
    "gelu_fast": ("gelu", True),
    "relu": ("relu", False),
    "silu": ("silu", False),
}
# our (activation, gelu_approximation) -> the HF hidden_act written for it
HF_ACTIVATION_NAMES = {("gelu", GELU_EXACT): "gelu", ("gelu", GELU_TANH): "gelu_pytorch_tanh",
                       ("relu", GELU_EXACT): "relu", ("silu", GELU_EXACT): "silu"}
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_PARTIAL_ROTARY = {"gpt_neox": 0.25}  # transformers' default when the key is absent (1.0 for the others)
_ROPE_BASE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")  # the rest of a block is the scaling


@dataclass(frozen=True)
class HFModelSpec:
    """What a config.json describes, in our terms."""

    family: str
    settings: dict[str, Any]  # settings a YAML may set (no derived ones)
    vocab_size: int  # our padded_vocab_size

    def architecture(self) -> Architecture:
        return architecture_of({**self.settings, "padded_vocab_size": self.vocab_size})


def architecture_of(values: dict[str, Any]) -> Architecture:
    """Our Architecture for a dict of settings (missing ones take their schema defaults).

    Validated as saved settings: an architecture alone is no complete run configuration.
    """
    return NeoXArgs.from_saved(values, "<model settings>").architecture()


def intermediate_settings(width: int, gated: bool, source: str) -> dict[str, int]:
    """intermediate_size and mlp_multiple_of with which GPT-NeoX's MLP rule builds exactly ``width`` per projection.

    Gated: int(3 * width * 2 / 3) = 2 * width for gate + up, half of it for linear2; ungated: width itself.
    """
    if not gated and width % 2:
        raise HFConversionError(
            f"{source}: intermediate_size={width} is odd; GPT-NeoX's MLP rule builds only even widths for "
            "an ungated MLP (linear1 is rounded up to a multiple of 2 x mlp_multiple_of)"
        )
    return {"intermediate_size": 3 * width if gated else width, "mlp_multiple_of": 1}


def _rope(hf: dict[str, Any], family: str, source: str) -> tuple[float, float, dict[str, Any] | None]:
    """(rope_theta, partial_rotary_factor, rope_scaling) from transformers-5 ``rope_parameters`` or the older
    top-level keys and ``rope_scaling``; the scaling is checked by the architecture."""
    params = hf.get("rope_parameters") or {}
    old_scaling = hf.get("rope_scaling") or {}
    scaling = None
    for name, block in (("rope_parameters", params), ("rope_scaling", old_scaling)):
        if not isinstance(block, dict) or any(isinstance(v, dict) for v in block.values()):
            raise HFConversionError(f"{source}: per-layer-type {name} are not supported; only one global rotary")
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type != "default":
            scaling = {"rope_type": rope_type, **{k: v for k, v in block.items() if k not in _ROPE_BASE_KEYS}}
    if scaling is not None and scaling["rope_type"] == "yarn" and scaling.get("factor") is None \
            and scaling.get("original_max_position_embeddings"):  # transformers' rule for a yarn without factor
        scaling["factor"] = hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", DEFAULT_ROPE_THETA)))
    factor = params.get(
        "partial_rotary_factor",
        hf.get("partial_rotary_factor", hf.get("rotary_pct", DEFAULT_PARTIAL_ROTARY.get(family, 1.0))),
    )
    return float(theta), float(factor), scaling


def _require(hf: dict[str, Any], key: str, source: str) -> Any:
    if hf.get(key) is None:
        raise HFConversionError(f"{source}: the key {key!r} is missing; cannot tell the model's shape without it")
    return hf[key]


def _sliding_window_width(hf: dict[str, Any], family: str, source: str) -> int | None:
    """Our sliding_window_width for Mistral's window (see the module docstring); Qwen's per-layer windows are refused."""
    if family in ("mistral", "mixtral"):
        window = hf.get("sliding_window")
        return None if window is None else int(window) - 1
    layer_types = hf.get("layer_types") or []
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and (hf.get("use_sliding_window") or "sliding_attention" in layer_types):
        raise HFConversionError(
            f"{source}: use_sliding_window / layer_types give some layers a sliding window and others none; a window "
            "on some layers only is not supported (set use_sliding_window: false to train every layer on the full prefix)")
    return None


def _experts(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """Our settings for the experts of a mixture-of-experts family; HFConversionError for what we cannot build."""
    # Qwen3-MoE's hub configs say num_experts; transformers 5 saves it as num_local_experts
    counts = {key: hf[key] for key in ("num_local_experts", "num_experts") if hf.get(key) is not None}
    if len(set(map(repr, counts.values()))) > 1:
        raise HFConversionError(f"{source}: num_local_experts is {counts['num_local_experts']!r} but num_experts is "
                                f"{counts['num_experts']!r}; give the model's expert count once")
    experts = next(iter(counts.values()), None)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 2:
        raise HFConversionError(f"{source}: num_local_experts / num_experts is {experts!r}; a mixture of experts "
                                "needs at least 2")
    if family == "mixtral" and hf.get("router_jitter_noise"):
        raise HFConversionError(f"{source}: router_jitter_noise={hf['router_jitter_noise']} is not supported; set "
                                "it to 0.0 (router jitter is not built)")
    values = {**HF_MOE_DEFAULTS, **HF_FAMILY_MOE_DEFAULTS.get(family, {}),
              **{k: v for k, v in hf.items() if k in HF_MOE_DEFAULTS and v is not None}}
    settings = {
        "moe_num_experts": experts,
        "moe_top_k": _require(hf, "num_experts_per_tok", source),
        "moe_expert_interval": _expert_interval(hf, source) if family in SOME_LAYERS_DENSE else 1,
        "moe_router_type": "topk",
        "moe_intermediate_size": _require(hf, "moe_intermediate_size" if family in SOME_LAYERS_DENSE
                                          else "intermediate_size", source),
        "moe_norm_topk_prob": family == "mixtral" or bool(values["norm_topk_prob"]),
        "moe_load_balancing_loss": bool(values["output_router_logits"]),
        "moe_load_balancing_loss_coef": float(values["router_aux_loss_coef"]),
    }
    if family == "qwen2_moe":
        shared = _require(hf, "shared_expert_intermediate_size", source)
        if not isinstance(shared, int) or shared < 1:
            raise HFConversionError(f"{source}: shared_expert_intermediate_size={shared!r}; Qwen2-MoE's shared expert "
                                    "needs a positive width")
        settings["moe_shared_expert_intermediate_size"] = shared
    return settings


def _expert_interval(hf: dict[str, Any], source: str) -> int:
    """GPT-NeoX's moe_expert_interval for the layers a Qwen-MoE config gives experts (see the module docstring)."""
    layers, step, dense = hf["num_hidden_layers"], hf.get("decoder_sparse_step"), hf.get("mlp_only_layers") or []
    step = 1 if step is None else step
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise HFConversionError(f"{source}: decoder_sparse_step is {step!r}; it must be a positive whole number "
                                "(every step-th layer has experts; 1: every layer)")
    with_experts = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    for interval in range(1, layers + 1):
        if with_experts == [i for i in range(layers) if i % interval == 0]:
            return interval
    raise HFConversionError(
        f"{source}: decoder_sparse_step={step} and mlp_only_layers={dense} give experts to layers {with_experts}; "
        "only layers 0, k, 2k, ... for some k can have them here (GPT-NeoX's moe_expert_interval), so this model "
        "cannot be built")


def _integral_theta(theta: float, source: str) -> int:
    if theta != int(theta):
        raise HFConversionError(f"{source}: rope_theta={theta} is not a whole number; our rotary_emb_base is an integer")
    return int(theta)


def spec_from_hf_config(hf: dict[str, Any], source: str = "config.json") -> HFModelSpec:
    """Our settings for the model a config.json describes; HFConversionError if we cannot represent it."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise HFConversionError(
            f"{source}: model_type {family!r} is not supported; convertible are {', '.join(FAMILIES)} "
            f"({', '.join(HF_CLASS_NAMES.values())})"
        )
    heads = _require(hf, "num_attention_heads", source)
    hidden = _require(hf, "hidden_size", source)
    theta, rotary_pct, rope_scaling = _rope(hf, family, source)
    max_positions = _require(hf, "max_position_embeddings", source)
    settings: dict[str, Any] = {
        "num_layers": _require(hf, "num_hidden_layers", source),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "seq_length": max_positions,
        "max_position_embeddings": max_positions,
        "pos_emb": "rotary",
        "rotary_pct": rotary_pct,
        "rotary_emb_base": _integral_theta(theta, source),
        "no_weight_tying": not hf.get("tie_word_embeddings", False),
        "attention_dropout": float(hf.get("attention_dropout") or 0.0),
        "rope_scaling": rope_scaling,
        "hf_model_type": family,
    }
    if is_reward_model_config(hf):
        settings["train_impl"] = "rm"
    width = _require(hf, "intermediate_size", source)
    if family == "gpt_neox":
        settings.update(_gpt_neox_layer(hf, width, source))
    else:
        settings.update(_llama_like_layer(hf, family, heads, hidden, rotary_pct, width, source))
    spec = HFModelSpec(family, settings, _require(hf, "vocab_size", source))
    try:
        spec.architecture()
    except (ModelConfigError, ConfigError) as err:
        raise HFConversionError(f"{source}: the model it describes is not valid for us: {err}") from None
    return spec


def _gpt_neox_layer(hf: dict[str, Any], width: int, source: str) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu")
    if act not in GPT_NEOX_ACTIVATIONS:
        raise HFConversionError(
            f"{source}: hidden_act {act!r} is not supported for gpt_neox; supported are "
            f"{', '.join(GPT_NEOX_ACTIVATIONS)}"
        )
    activation, tanh_gelu = GPT_NEOX_ACTIVATIONS[act]
    return {
        **intermediate_settings(width, False, source),
        "num_kv_heads": None,
        "gpt_j_residual": bool(hf.get("use_parallel_residual", True)),
        "norm": "layernorm",
        "layernorm_epsilon": float(hf.get("layer_norm_eps", 1e-5)),
        "activation": activation,
        "bias_gelu_fusion": tanh_gelu,
        "use_bias_in_norms": True,
        "use_bias_in_attn_linear": bool(hf.get("attention_bias", True)),
        "use_bias_in_mlp": True,
        "hidden_dropout": float(hf.get("hidden_dropout") or 0.0),
    }


def _llama_like_layer(hf: dict[str, Any], family: str, heads: int, hidden: int, rotary_pct: float, width: int,
                      source: str) -> dict[str, Any]:
    """The layer settings of the SwiGLU/RMSNorm families (Llama, Mistral, Qwen, OLMoE and their experts)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFConversionError(f"{source}: hidden_act {act!r} is not supported for {family}; only 'silu' (SwiGLU)")
    if rotary_pct != 1.0:
        raise HFConversionError(f"{source}: partial_rotary_factor={rotary_pct} is not supported for {family}")
    if family == "olmoe" and hf.get("clip_qkv") is not None:
        raise HFConversionError(f"{source}: clip_qkv={hf['clip_qkv']} clamps the queries, keys and values, which "
                                "is not built; only clip_qkv: null is supported")
    head_dim = hf.get("head_dim") or hidden // heads
    settings = {
        **intermediate_settings(width, True, source),
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "kv_channels": None if head_dim * heads == hidden else head_dim,
        "gpt_j_residual": False,
        "norm": "rmsnorm",
        "rms_norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "activation": "swiglu",
        "use_bias_in_norms": False,
        # Qwen2 has biases on q/k/v alone; Mistral none; Llama and Qwen3 say so in attention_bias
        "use_bias_in_attn_linear": family in ("llama", "qwen3", "qwen3_moe", "olmoe")
        and bool(hf.get("attention_bias", False)),
        "add_qkv_bias": family == "qwen2" or (family == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
        "use_bias_in_mlp": family == "llama" and bool(hf.get("mlp_bias", False)),
        "qk_layernorm": family in PER_HEAD_QK_NORM,
        "qk_layernorm_across_heads": family == "olmoe",
        "sliding_window_width": _sliding_window_width(hf, family, source),
        "hidden_dropout": 0.0,
    }
    if family in MIXTURES_OF_EXPERTS:
        settings.update(_experts(hf, family, source))
    return settings


def unrepresentable(arch: Architecture, family: str) -> list[str]:
    """Why ``arch`` cannot be written as ``family``; empty when it can."""
    problems = []
    if arch.pos_emb != "rotary":
        problems.append(f"pos_emb={arch.pos_emb!r} (both families use rotary)")
    if family == "gpt_neox":
        wanted = {"norm": "layernorm", "bias_in_norms": True, "bias_in_mlp": True}
        if (arch.activation, arch.gelu_approximation) not in HF_ACTIVATION_NAMES:
            problems.append(f"activation={arch.activation!r} with GELU approximation {arch.gelu_approximation!r} "
                            f"(gpt_neox has {', '.join(GPT_NEOX_ACTIVATIONS)})")
        if arch.num_kv_heads != arch.num_attention_heads:
            problems.append(f"num_kv_heads={arch.num_kv_heads} (gpt_neox has no grouped-query attention)")
    elif family in LLAMA_LIKE:
        wanted = {"norm": "rmsnorm", "activation": "swiglu", "parallel_residual": False, "rotary_pct": 1.0,
                  "qk_layernorm": family in PER_HEAD_QK_NORM, "qk_layernorm_across_heads": family == "olmoe",
                  "bias_in_norms": False}
        if family not in ("mistral", "mixtral"):
            wanted["sliding_window_width"] = None
        if family != "llama":
            wanted["bias_in_mlp"] = False
        if family == "qwen2":
            wanted.update(add_qkv_bias=True, bias_in_attn_linear=False)
        elif family in ("mistral", "mixtral"):
            wanted.update(add_qkv_bias=False, bias_in_attn_linear=False)
        elif family == "qwen2_moe":  # q/k/v biases as qkv_bias says, none on the output projection
            wanted.update(bias_in_attn_linear=False)
        elif arch.add_qkv_bias and not arch.bias_in_attn_linear:
            problems.append(f"add_qkv_bias without use_bias_in_attn_linear ({family} has biases on every attention "
                            "projection or none; qwen2 has them on q/k/v alone)")
    else:
        return [f"architecture {family!r} (supported: {', '.join(FAMILIES)})"]
    if family == "gpt_neox":
        for field in ("qk_layernorm", "add_qkv_bias"):
            if getattr(arch, field):
                problems.append(f"{field}=True (gpt_neox has no such option)")
        if arch.head_dim * arch.num_attention_heads != arch.hidden_size:
            problems.append(f"kv_channels={arch.head_dim} (gpt_neox's head width is hidden_size / heads)")
    if family == "olmoe" and arch.head_dim * arch.num_attention_heads != arch.hidden_size:
        problems.append(f"kv_channels={arch.head_dim} (olmoe's query norm is hidden_size wide: heads of "
                        "hidden_size / heads)")
        if arch.sliding_window_width is not None:
            problems.append(f"sliding_window_width={arch.sliding_window_width} (gpt_neox has no sliding window)")
    if family in MIXTURES_OF_EXPERTS:
        if not arch.moe:
            problems.append(f"moe_num_experts={arch.moe_num_experts} ({family} is a mixture of experts)")
        wanted["moe_router_type"] = "topk"  # sinkhorn routes otherwise in training
        if family not in SOME_LAYERS_DENSE:
            wanted["moe_expert_interval"] = 1
        if family == "mixtral":
            wanted["moe_norm_topk_prob"] = True
        if family != "qwen2_moe":
            wanted["moe_shared_expert_intermediate_size"] = 0
        elif not arch.moe_shared_expert_intermediate_size:
            problems.append("moe_shared_expert_intermediate_size=0 (qwen2_moe has a shared expert)")
    elif arch.moe:
        problems.append(f"moe_num_experts={arch.moe_num_experts} ({family} has no experts; "
                        f"{', '.join(MIXTURES_OF_EXPERTS)} do)")
    problems += [
        f"{field}={getattr(arch, field)!r} ({family} needs {value!r})"
        for field, value in wanted.items()
        if getattr(arch, field) != value
    ]
    return problems


def hf_config_from_architecture(arch: Architecture, family: str, dtype: str) -> dict[str, Any]:
    """config.json for ``arch`` as ``family``; the caller has checked ``unrepresentable`` is empty."""
    rope = {**(arch.rope_scaling or {"rope_type": "default"}), "rope_theta": arch.rotary_emb_base}
    common = {
        "architectures": [hf_class_name(family, arch.reward_head)],
        "model_type": family,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "intermediate_size": arch.intermediate_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tied_embeddings,
        "attention_bias": arch.bias_in_attn_linear,
        "attention_dropout": arch.attention_dropout,
        "initializer_range": arch.init_method_std,
        "dtype": dtype,
        "use_cache": True,
        **({"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}} if arch.reward_head else {}),
    }
    if family == "gpt_neox":
        rope["partial_rotary_factor"] = arch.rotary_pct
        return {
            **common,
            "hidden_act": HF_ACTIVATION_NAMES[arch.activation, arch.gelu_approximation],
            "layer_norm_eps": arch.norm_epsilon,
            "use_parallel_residual": arch.parallel_residual,
            "hidden_dropout": arch.hidden_dropout,
            "rope_parameters": rope,
            # the same values under the names transformers 4 reads
            "rotary_pct": arch.rotary_pct,
            "rotary_emb_base": arch.rotary_emb_base,
        }
    config = {
        **common,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.norm_epsilon,
        "rope_parameters": rope,
        "rope_theta": arch.rotary_emb_base,  # transformers 4's name
    }
    if family == "llama":
        config["mlp_bias"] = arch.bias_in_mlp
    if family in ("mistral", "qwen2", "mixtral", "qwen2_moe"):
        del config["attention_bias"]  # fixed by the family (see spec_from_hf_config)
    if family in ("mistral", "mixtral"):
        config["sliding_window"] = None if arch.sliding_window_width is None else arch.sliding_window_width + 1
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None)
    if family in MIXTURES_OF_EXPERTS:
        config.update(num_experts_per_tok=arch.moe_top_k, output_router_logits=arch.moe_load_balancing_loss,
                      router_aux_loss_coef=arch.moe_load_balancing_loss_coef)
    if family == "mixtral":  # its intermediate_size is each expert's width
        config.update(intermediate_size=arch.moe_intermediate_size, num_local_experts=arch.moe_num_experts,
                      router_jitter_noise=0.0)
    if family in SOME_LAYERS_DENSE:
        config.update(moe_intermediate_size=arch.moe_intermediate_size, num_experts=arch.moe_num_experts,
                      norm_topk_prob=arch.moe_norm_topk_prob, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(arch.num_layers) if not arch.has_experts(i)])
    if family == "qwen2_moe":
        config.update(shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
                      qkv_bias=arch.add_qkv_bias)
    if family == "olmoe":  # its intermediate_size is each expert's width
        config.update(intermediate_size=arch.moe_intermediate_size, num_experts=arch.moe_num_experts,
                      norm_topk_prob=arch.moe_norm_topk_prob, clip_qkv=None)
    if family in ("qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe") \
            and arch.head_dim * arch.num_attention_heads == arch.hidden_size:
        del config["head_dim"]  # their configs leave it unset (Qwen2Config has no such key); the attention reads one
    return config
