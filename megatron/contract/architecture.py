"""The model's architecture: one contract, resolved once from plain setting values.

Every part that needs the model's shape takes an ``Architecture``: ``build_model``, the load
plan's compatibility check, the Hugging Face config mapping and the converters. It is resolved by
``architecture_from_settings`` from a mapping of settings (names and meanings as in GPT-NeoX).
This module imports nothing from the rest of the package but its error base (megatron/errors.py),
so any layer may depend on it.

A load is refused when a field of ``FIELDS_THAT_REFUSE_A_LOAD`` differs between the checkpoint
(or Hugging Face config.json) and the run, whatever the checkpoint's source:

| field                   | from the settings                                  | compared when           |
|-------------------------|----------------------------------------------------|-------------------------|
| num_layers              | num_layers                                         | always                  |
| hidden_size             | hidden_size                                        | always                  |
| num_attention_heads     | num_attention_heads                                | always                  |
| num_kv_heads            | num_kv_heads (unset: one per query head)           | always                  |
| intermediate_size       | GPT-NeoX's MLP rule (``mlp_widths``), as built     | always                  |
| vocab_size              | padded_vocab_size                                  | always                  |
| max_position_embeddings | max_position_embeddings (unset: seq_length)        | pos_emb is learned      |
| pos_emb                 | pos_emb                                            | always                  |
| rotary_pct              | rotary_pct                                         | pos_emb is rotary       |
| rotary_emb_base         | rotary_emb_base                                    | pos_emb is rotary       |
| norm                    | norm                                               | always                  |
| norm_epsilon            | layernorm_epsilon or rms_norm_epsilon, per norm    | always                  |
| activation              | activation                                         | always                  |
| gelu_approximation      | bias_gelu_fusion (tanh), onnx_safe (erf, GPT-NeoX) | activation is gelu      |
| bias_in_norms           | use_bias_in_norms                                  | norm is layernorm       |
| bias_in_attn_linear     | use_bias_in_attn_linear                            | always                  |
| bias_in_mlp             | use_bias_in_mlp                                    | always                  |
| tied_embeddings         | not no_weight_tying                                | always                  |
| parallel_residual       | gpt_j_residual                                     | always                  |
| sliding_window_width    | sliding_window_width (unset: no window; Mistral)   | the setting is known    |
| kv_channels             | kv_channels (unset: hidden_size / heads; Qwen3)    | always                  |
| qk_layernorm            | qk_layernorm (Qwen3)                               | the setting is known    |
| qk_layernorm_across_heads | qk_layernorm_across_heads (OLMoE)                | the setting is known    |
| add_qkv_bias            | add_qkv_bias (Qwen2)                               | the setting is known    |
| rope_scaling            | rope_scaling (Llama 3.1+, Qwen's yarn)             | pos_emb is rotary       |
| moe_num_experts         | moe_num_experts (GPT-NeoX; Mixtral, Qwen3-MoE)     | always                  |
| moe_top_k               | moe_top_k                                          | moe_num_experts > 1     |
| moe_expert_interval     | moe_expert_interval                                | moe_num_experts > 1     |
| moe_intermediate_size   | GPT-NeoX's expert width rule (``expert_width``)    | moe_num_experts > 1     |
| moe_norm_topk_prob      | moe_norm_topk_prob                                 | moe_num_experts > 1     |
| moe_router_type         | moe_router_type                                    | moe_num_experts > 1     |
| moe_shared_expert_intermediate_size | moe_shared_expert_intermediate_size (unset: 0; Qwen2-MoE) | moe_num_experts > 1 |

Settings saved by another program may lack some keys: a field whose settings are missing is not
compared (``fields_of_settings``). The other fields (dropout, initialisation, activation
recomputation, tensor-parallel size) shape how the model trains or is laid out, not the function
its weights compute, and never refuse a load here.

GPT-NeoX's MLP rule (``ParallelMLP``): ``intermediate_size`` (unset: 4 x hidden_size) is the
ungated width; a gated activation (swiglu) takes ``int(intermediate_size * 2 / 3)`` for the fused
gate + up projection ``linear1``, rounded up to a multiple of ``2 * mlp_multiple_of``, and half of
it, rounded up to ``mlp_multiple_of``, as ``linear2``'s input. Llama-7B's ``intermediate_size:
32768`` with ``mlp_multiple_of: 256`` builds 11008 per projection. ``Architecture.intermediate_size``
is that built width per projection (Hugging Face's ``intermediate_size``).

RoPE scaling (``rope_scaling``) is given as a Hugging Face checkpoint records it, a mapping with
``rope_type`` and that type's parameters (``ROPE_SCALING_KEYS``): ``linear`` divides every frequency
by ``factor``; ``llama3`` divides the low frequencies by ``factor`` and blends the middle ones
(Llama 3.1+); ``yarn`` blends interpolated and extrapolated frequencies and scales cos and sin by an
attention factor (Qwen's long context). ``dynamic`` changes the frequencies with each input's length
at inference, so a trained model would depend on the batch's length; it is refused.

Mixture of experts (``moe_num_experts`` > 1, GPT-NeoX's settings): layer ``i`` (0-based) has experts in place
of its MLP when ``i % moe_expert_interval == 0``, as in GPT-NeoX. A router (hidden -> experts, no bias) scores
each token; with ``moe_router_type: topk`` its softmax's ``moe_top_k`` largest probabilities pick the experts,
renormalised to sum to 1 with ``moe_norm_topk_prob`` (Mixtral; Qwen3-MoE says in its config; GPT-NeoX's topk
router does not), and weigh their outputs; GPT-NeoX's ``sinkhorn`` router picks them in training by a
Sinkhorn-balanced assignment and weighs them by the sigmoid (top 1) or softmax of their logits
(megatron/model/moe.py). ``moe_jitter_eps`` (topk only) jitters the router's input in training. No token is
dropped. Each expert is the model's MLP without biases (``use_bias_in_mlp`` is for the layers without
experts, as in GPT-NeoX), ``expert_width`` wide per projection: ``moe_intermediate_size``, else GPT-NeoX's
rule for experts (``intermediate_size`` itself, unset: 4 x hidden, for swiglu 8/3 x hidden, rounded up to
256). The experts are split over the tensor-parallel ranks as GPT-NeoX splits them (``experts_per_rank``):
``moe_num_experts`` a multiple of ``model_parallel_size``, rank r holding the r-th run of whole experts. With
``moe_shared_expert_intermediate_size`` (Qwen2-MoE's shared expert) every token also goes through the model's dense MLP of that width (no biases), whose output,
weighed by the sigmoid of a linear of the token (``shared_expert_gate``, hidden -> 1), is added to the experts'.
The load-balancing loss (``moe_load_balancing_loss``, ``moe_load_balancing_loss_coef``: Hugging Face's
``output_router_logits`` and ``router_aux_loss_coef``) shapes how the model trains, not the function its
weights compute, and refuses no load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.errors import ExpectedError

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "relu", "silu", "swiglu")
GATED_ACTIVATIONS = ("swiglu",)
POSITION_EMBEDDINGS = ("learned", "rotary", "none")
MOE_DEFAULT_WIDTH_MULTIPLE = 256  # GPT-NeoX rounds its default expert width up to this
INIT_METHODS = ("normal", "small_init", "wang_init", "scaled_normal")
# GELU as GPT-NeoX computes it: exact (erf), tanh (bias_gelu_fusion), or erf with 1.41421 for sqrt(2) (onnx_safe)
GELU_EXACT, GELU_TANH, GELU_ONNX_ERF = "none", "tanh", "onnx_erf"


class ModelConfigError(ExpectedError, ValueError):
    """The settings do not describe a model that can be built; the message says which and how to fix it."""


@dataclass(frozen=True)
class Architecture:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int  # MLP inner width per projection, as built (linear2's input)
    vocab_size: int
    max_position_embeddings: int | None
    pos_emb: str
    rotary_pct: float
    rotary_emb_base: float
    tied_embeddings: bool
    parallel_residual: bool
    norm: str
    norm_epsilon: float
    activation: str
    gelu_approximation: str
    bias_in_norms: bool
    bias_in_attn_linear: bool
    bias_in_mlp: bool
    hidden_dropout: float
    attention_dropout: float
    init_method: str
    output_layer_init_method: str
    init_method_std: float
    checkpoint_activations: bool
    model_parallel_size: int = 1
    sequence_parallel: bool = False  # split the residual stream along the sequence over the tensor-parallel ranks
    context_parallel_size: int = 1  # ranks splitting each sequence (megatron/model/context_parallel.py)
    sliding_window_width: int | None = None  # Mistral: keys at most this many positions back, and the query's own
    kv_channels: int | None = None  # each head's width (Hugging Face's head_dim); None: hidden_size / heads
    qk_layernorm: bool = False  # a norm over each head's query and key, weights per projection (Qwen3)
    qk_layernorm_across_heads: bool = False  # instead: one norm over all heads' queries, one over the keys (OLMoE)
    add_qkv_bias: bool = False  # biases on the query/key/value projection alone (Qwen2)
    rope_scaling: dict[str, Any] | None = None  # rope_type and its parameters (see the module docstring)
    # train_impl rm: the output layer is a scalar head (rm_linear, hidden -> 1) instead of final_linear
    reward_head: bool = False
    moe_num_experts: int = 1  # > 1: mixture of experts (see the module docstring)
    moe_top_k: int = 1
    moe_expert_interval: int = 1
    moe_intermediate_size: int | None = None  # each expert's width per projection, as built (``expert_width``)
    moe_norm_topk_prob: bool = False
    moe_router_type: str = "topk"  # "topk" or GPT-NeoX's "sinkhorn"
    moe_shared_expert_intermediate_size: int = 0  # > 0: a gated shared expert this wide beside the experts
    moe_jitter_eps: float | None = None  # training only: the router's input times uniform noise in [1 -/+ eps]
    moe_load_balancing_loss: bool = False
    moe_load_balancing_loss_coef: float = 0.001

    @property
    def moe(self) -> bool:
        return self.moe_num_experts > 1

    def has_experts(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has experts in place of its MLP (GPT-NeoX's moe_expert_interval)."""
        return self.moe and layer % self.moe_expert_interval == 0

    @property
    def splits_sequence(self) -> bool:
        """Whether the residual stream is split along the sequence (megatron/model/sequence_parallel.py)."""
        return self.sequence_parallel and self.model_parallel_size > 1

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.bias_in_attn_linear or self.add_qkv_bias

    @property
    def rotary_ndims(self) -> int:
        return int(self.head_dim * self.rotary_pct) if self.pos_emb == "rotary" else 0

    @property
    def gated(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    @property
    def linear1_width(self) -> int:
        """Output width of the MLP's first projection (gate and up stacked for gated activations)."""
        return (2 if self.gated else 1) * self.intermediate_size

    def compared_fields(self) -> dict[str, Any]:
        """The fields of FIELDS_THAT_REFUSE_A_LOAD that matter for this model (see the table above)."""
        return _relevant(dataclasses.asdict(self))


# field -> the settings a user changes to match it (shown when a load is refused)
FIELDS_THAT_REFUSE_A_LOAD: dict[str, str] = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_kv_heads",
    "intermediate_size": "intermediate_size, mlp_multiple_of",
    "vocab_size": "padded_vocab_size, from the tokenizer and make_vocab_size_divisible_by",
    "max_position_embeddings": "max_position_embeddings",
    "pos_emb": "pos_emb",
    "rotary_pct": "rotary_pct",
    "rotary_emb_base": "rotary_emb_base",
    "norm": "norm",
    "norm_epsilon": "layernorm_epsilon or rms_norm_epsilon",
    "activation": "activation",
    "gelu_approximation": "bias_gelu_fusion, onnx_safe",
    "bias_in_norms": "use_bias_in_norms",
    "bias_in_attn_linear": "use_bias_in_attn_linear",
    "bias_in_mlp": "use_bias_in_mlp",
    "tied_embeddings": "no_weight_tying",
    "parallel_residual": "gpt_j_residual",
    "sliding_window_width": "sliding_window_width",
    "kv_channels": "kv_channels",
    "qk_layernorm": "qk_layernorm",
    "qk_layernorm_across_heads": "qk_layernorm_across_heads",
    "add_qkv_bias": "add_qkv_bias",
    "rope_scaling": "rope_scaling",
    "moe_num_experts": "moe_num_experts",
    "moe_top_k": "moe_top_k",
    "moe_expert_interval": "moe_expert_interval",
    "moe_intermediate_size": "moe_intermediate_size, intermediate_size",
    "moe_norm_topk_prob": "moe_norm_topk_prob",
    "moe_router_type": "moe_router_type",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
}
_MOE_FIELDS = ("moe_top_k", "moe_expert_interval", "moe_intermediate_size", "moe_norm_topk_prob", "moe_router_type",
               "moe_shared_expert_intermediate_size")
ROUTER_TYPES = ("sinkhorn", "topk")
_UNSET_IS_A_VALUE = ("sliding_window_width", "rope_scaling")  # None means "no window", "plain rotary"

# rope_type -> (its required parameters, its optional ones), as Hugging Face's rope_parameters name them
ROPE_SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")),
}
_ROPE_SCALING_INTEGERS = ("original_max_position_embeddings",)
_ROPE_SCALING_BOOLEANS = ("truncate",)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def ungated_mlp_width(hidden_size: int, intermediate_size: int | None) -> int:
    """intermediate_size, or GPT-NeoX's default for it: 4 x hidden_size."""
    return intermediate_size or 4 * hidden_size


def mlp_widths(hidden_size: int, intermediate_size: int | None, activation: str, multiple_of: int) -> tuple[int, int]:
    """(linear1's output width, linear2's input width) by GPT-NeoX's rule; see the module docstring."""
    width = ungated_mlp_width(hidden_size, intermediate_size)
    inner = width
    if activation in GATED_ACTIVATIONS:
        width = int(width * 2 / 3)
        inner = width // 2
    return _round_up(width, 2 * multiple_of), _round_up(inner, multiple_of)


def built_intermediate_size(hidden_size: int, intermediate_size: int | None, activation: str, multiple_of: int) -> int:
    """The MLP width per projection GPT-NeoX builds; ModelConfigError where its two projections would not fit."""
    linear1, linear2_in = mlp_widths(hidden_size, intermediate_size, activation, multiple_of)
    gated = activation in GATED_ACTIVATIONS
    if linear1 != (2 if gated else 1) * linear2_in:
        given = f"intermediate_size={intermediate_size}" if intermediate_size else f"intermediate_size unset (4 x hidden = {4 * hidden_size})"
        raise ModelConfigError(
            f"{given} with mlp_multiple_of={multiple_of} and activation={activation!r} gives linear1 {linear1} wide "
            f"but linear2 {linear2_in} wide under GPT-NeoX's MLP rule{' (gate + up: twice linear2)' if gated else ''}, "
            f"which GPT-NeoX cannot build either; set intermediate_size so that "
            f"{'int(intermediate_size * 2 / 3) is even' if gated else 'it is a multiple of 2 x mlp_multiple_of'}, "
            "or raise mlp_multiple_of"
        )
    return linear2_in


def expert_width(hidden_size: int, moe_intermediate_size: int | None, intermediate_size: int | None,
                 activation: str) -> int:
    """Each expert's width per projection: moe_intermediate_size, else GPT-NeoX's rule for experts
    (``ParallelGroupedMLP``): intermediate_size itself, unset 4 x hidden (swiglu: int(8/3 x hidden)) rounded up to 256."""
    if moe_intermediate_size:
        return moe_intermediate_size
    if intermediate_size:
        return intermediate_size
    default = int(2 * hidden_size * 4 / 3) if activation in GATED_ACTIVATIONS else 4 * hidden_size
    return _round_up(default, MOE_DEFAULT_WIDTH_MULTIPLE)


def query_key_norm_problem(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the setting to change, why) when the query/key norm settings cannot be built together; None otherwise."""
    if not values.get("qk_layernorm_across_heads"):
        return None
    if values.get("qk_layernorm"):
        return "qk_layernorm_across_heads", ("qk_layernorm is set too; a query/key norm is either per head "
                                             "(qk_layernorm, Qwen3) or across heads (OLMoE): set one")
    tp = values.get("model_parallel_size") or 1
    if tp == 1:
        return None
    if values.get("norm") != "rmsnorm":
        return "norm", (f"{values.get('norm')}: qk_layernorm_across_heads splits over tensor-parallel ranks with "
                        f"rmsnorm only; set norm: rmsnorm or model_parallel_size: 1")
    kv_heads = values.get("num_kv_heads") or values["num_attention_heads"]
    if kv_heads < tp:
        return "model_parallel_size", (f"{tp}: qk_layernorm_across_heads sums the keys' squares over the ranks, and "
                                       f"with fewer key/value heads ({kv_heads}) than ranks a head several ranks "
                                       f"hold would count more than once; set model_parallel_size to at most {kv_heads}")
    return None


def experts_per_rank(num_experts: int, tensor_parallel_size: int) -> int:
    """How many whole experts each tensor-parallel rank holds: rank r holds experts r x that .. (r + 1) x that - 1
    (GPT-NeoX's ParallelDroplessMLP, whose expert-parallel group is the model-parallel group)."""
    count, rest = divmod(num_experts, tensor_parallel_size)
    if rest:
        raise ModelConfigError(f"{num_experts} experts (moe_num_experts) cannot be split evenly over "
                               f"{tensor_parallel_size} tensor-parallel ranks: each rank holds whole experts")
    return count


def mixture_of_experts_problem(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the setting to change, why) when these settings ask for experts the model cannot build; None otherwise."""
    experts = values.get("moe_num_experts") or 1
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        return "moe_num_experts", f"must be a positive integer (1: no experts), got {experts!r}"
    if experts == 1:
        return None
    top_k, interval = values.get("moe_top_k"), values.get("moe_expert_interval")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        return "moe_top_k", f"{top_k!r} experts per token: must lie between 1 and moe_num_experts ({experts})"
    if not isinstance(interval, int) or interval < 1:
        return "moe_expert_interval", f"must be a positive integer (1: experts in every layer), got {interval!r}"
    for name in ("moe_intermediate_size", "moe_shared_expert_intermediate_size"):
        width = values.get(name)
        if width is not None and (not isinstance(width, int) or isinstance(width, bool) or width < 0
                                  or (width == 0 and name == "moe_intermediate_size")):
            return name, f"must be a positive integer when set, got {width!r}"
    router = values.get("moe_router_type")
    if router not in ROUTER_TYPES:
        return "moe_router_type", f"{router!r} is no router; set one of {', '.join(ROUTER_TYPES)}"
    jitter = values.get("moe_jitter_eps")
    if jitter is not None and (not isinstance(jitter, (int, float)) or isinstance(jitter, bool) or not 0 <= jitter < 1):
        return "moe_jitter_eps", f"must lie in [0, 1) (the router's input times 1 -/+ it), got {jitter!r}"
    if jitter and router == "sinkhorn":
        return "moe_jitter_eps", ("only the topk router jitters its input (GPT-NeoX's sinkhorn router ignores "
                                  "moe_jitter_eps); remove it, or set moe_router_type: topk")
    try:
        experts_per_rank(experts, values.get("model_parallel_size") or 1)
    except ModelConfigError as err:
        return "model_parallel_size", f"{err}, as in GPT-NeoX; set a model_parallel_size that divides moe_num_experts"
    return None


def gelu_approximation(activation: str, bias_gelu_fusion: bool, onnx_safe: bool) -> str:
    """GPT-NeoX's GELU variant: bias_gelu_fusion selects the tanh form, onnx_safe an erf form; only for gelu."""
    if activation != "gelu":
        return GELU_EXACT
    if bias_gelu_fusion and onnx_safe:
        raise ModelConfigError("bias_gelu_fusion and onnx_safe select different GELUs (as in GPT-NeoX); set at most one")
    if bias_gelu_fusion:
        return GELU_TANH
    return GELU_ONNX_ERF if onnx_safe else GELU_EXACT


_MISSING = object()


class _FieldReader:
    """Reads fields from settings values: ``get`` a setting (None is _MISSING), ``derive`` a field from some."""

    def __init__(self, values: Mapping[str, Any], strict: bool):
        self.values = values
        self.strict = strict

    def get(self, name: str) -> Any:
        value = self.values.get(name, _MISSING)
        return _MISSING if value is None else value

    def derive(self, fn, *names: str) -> Any:
        given = [self.get(name) for name in names]
        if any(value is _MISSING for value in given):
            return _MISSING
        try:
            return fn(*given)
        except (TypeError, ValueError):
            if self.strict:
                raise
            return _MISSING


def _fields(values: Mapping[str, Any], strict: bool = True) -> dict[str, Any]:
    """Every field these settings determine; a field whose settings are missing (or None) is _MISSING.

    Not ``strict``: a field whose settings another program saved in a form we cannot read is _MISSING too.
    """
    read = _FieldReader(values, strict)
    return {**_shape_fields(read), **_layer_fields(read), **_expert_fields(read)}


def _shape_fields(read: _FieldReader) -> dict[str, Any]:
    values, get, derive = read.values, read.get, read.derive
    heads = get("num_attention_heads")
    kv_heads = get("num_kv_heads")
    seq_length = get("seq_length")
    max_positions = get("max_position_embeddings")
    return {
        "num_layers": get("num_layers"),
        "hidden_size": get("hidden_size"),
        "num_attention_heads": heads,
        "num_kv_heads": heads if kv_heads is _MISSING else kv_heads,
        "intermediate_size": derive(
            lambda hidden, activation, multiple_of: built_intermediate_size(
                hidden, values.get("intermediate_size"), activation, multiple_of),
            "hidden_size", "activation", "mlp_multiple_of"),
        "vocab_size": get("padded_vocab_size"),
        "max_position_embeddings": seq_length if max_positions is _MISSING else max_positions,
        "model_parallel_size": values.get("model_parallel_size") or 1,
        "context_parallel_size": values.get("context_parallel_size") or 1,
        "kv_channels": derive(lambda hidden, heads: hidden // heads, "hidden_size", "num_attention_heads")
        if get("kv_channels") is _MISSING else get("kv_channels"),
        "reward_head": values.get("train_impl") == "rm",
    }


def _layer_fields(read: _FieldReader) -> dict[str, Any]:
    values, get, derive = read.values, read.get, read.derive
    norm = get("norm")
    epsilon_name = {"layernorm": "layernorm_epsilon", "rmsnorm": "rms_norm_epsilon"}.get(norm)
    return {
        "pos_emb": get("pos_emb"),
        "rotary_pct": derive(float, "rotary_pct"),
        "rotary_emb_base": derive(float, "rotary_emb_base"),
        "tied_embeddings": derive(lambda untied: not untied, "no_weight_tying"),
        "parallel_residual": derive(bool, "gpt_j_residual"),
        "norm": norm,
        "norm_epsilon": derive(float, epsilon_name) if epsilon_name else _MISSING,
        "activation": get("activation"),
        "gelu_approximation": derive(
            lambda activation: gelu_approximation(
                activation, bool(values.get("bias_gelu_fusion")), bool(values.get("onnx_safe"))),
            "activation"),
        "bias_in_norms": derive(lambda bias, kind: bool(bias) and kind == "layernorm", "use_bias_in_norms", "norm"),
        "bias_in_attn_linear": derive(bool, "use_bias_in_attn_linear"),
        "bias_in_mlp": derive(bool, "use_bias_in_mlp"),
        "hidden_dropout": derive(float, "hidden_dropout"),
        "attention_dropout": derive(float, "attention_dropout"),
        "init_method": get("init_method"),
        "output_layer_init_method": get("output_layer_init_method"),
        "init_method_std": derive(float, "init_method_std"),
        "checkpoint_activations": derive(bool, "checkpoint_activations"),
        "sequence_parallel": bool(values.get("sequence_parallel")),
        "sliding_window_width": values.get("sliding_window_width", _MISSING),
        "qk_layernorm": derive(bool, "qk_layernorm"),
        "qk_layernorm_across_heads": derive(bool, "qk_layernorm_across_heads"),
        "add_qkv_bias": derive(bool, "add_qkv_bias"),
        "rope_scaling": values.get("rope_scaling", _MISSING) if read.strict
        else _lenient(rope_scaling_of, values.get("rope_scaling", _MISSING)),
    }


def _expert_fields(read: _FieldReader) -> dict[str, Any]:
    values, get, derive = read.values, read.get, read.derive
    return {
        "moe_num_experts": derive(int, "moe_num_experts"),
        "moe_top_k": derive(int, "moe_top_k"),
        "moe_expert_interval": derive(int, "moe_expert_interval"),
        "moe_intermediate_size": derive(
            lambda hidden, activation: expert_width(
                hidden, values.get("moe_intermediate_size"), values.get("intermediate_size"), activation),
            "hidden_size", "activation"),
        "moe_norm_topk_prob": derive(bool, "moe_norm_topk_prob"),
        "moe_router_type": get("moe_router_type"),
        # unset is none: settings saved before it existed, or by GPT-NeoX, had no shared expert
        "moe_shared_expert_intermediate_size": values.get("moe_shared_expert_intermediate_size") or 0,
        "moe_jitter_eps": values.get("moe_jitter_eps"),
        "moe_load_balancing_loss": derive(bool, "moe_load_balancing_loss"),
        "moe_load_balancing_loss_coef": derive(float, "moe_load_balancing_loss_coef"),
    }


def _lenient(fn, value: Any) -> Any:
    """fn(value), or _MISSING where value is missing or not in a form fn reads."""
    if value is _MISSING:
        return _MISSING
    try:
        return fn(value)
    except (TypeError, ValueError):
        return _MISSING


def _relevant(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The compared fields that are known and matter, given the others (see the table above)."""
    known = {name: fields[name] for name in FIELDS_THAT_REFUSE_A_LOAD
             if fields.get(name, _MISSING) is not _MISSING
             and (fields[name] is not None or name in _UNSET_IS_A_VALUE)}
    pos_emb = known.get("pos_emb")
    if pos_emb != "learned":
        known.pop("max_position_embeddings", None)
    if pos_emb is not None and pos_emb != "rotary":
        known.pop("rotary_pct", None)
        known.pop("rotary_emb_base", None)
        known.pop("rope_scaling", None)
    if known.get("activation", "gelu") != "gelu":
        known.pop("gelu_approximation", None)
    if known.get("norm", "layernorm") != "layernorm":
        known.pop("bias_in_norms", None)
    if known.get("moe_num_experts", 1) <= 1:
        for name in _MOE_FIELDS:
            known.pop(name, None)
    return known


def fields_of_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The compared fields that ``values`` (settings, possibly partial: saved by another program) determine.

    Fields whose settings are missing are left out, so partial settings are compared on what is there.
    """
    return _relevant(_fields(values, strict=False))


@dataclass(frozen=True)
class Mismatch:
    field: str
    theirs: Any
    ours: Any

    def describe(self, theirs_label: str = "saved", ours_label: str = "now") -> str:
        settings = FIELDS_THAT_REFUSE_A_LOAD[self.field]
        hint = "" if settings == self.field else f" (set by {settings})"
        return f"{self.field}: {theirs_label} {self.theirs!r}, {ours_label} {self.ours!r}{hint}"


def architecture_mismatches(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> list[Mismatch]:
    """Each field of FIELDS_THAT_REFUSE_A_LOAD on which two sets of compared fields (``fields_of_settings``,
    ``Architecture.compared_fields``; possibly partial) differ."""
    return [Mismatch(name, theirs[name], ours[name]) for name in FIELDS_THAT_REFUSE_A_LOAD
            if name in theirs and name in ours and theirs[name] != ours[name]]


def gpt_neox_shaped(norm: str, activation: str) -> bool:
    """Whether a model of this norm and activation is of GPT-NeoX's family (else Llama's or a relative's)."""
    return not (norm == "rmsnorm" and activation == "swiglu")


def implied_family(arch: Architecture) -> str:
    """The family (as Hugging Face's model_type) ``arch`` implies: gpt_neox unless RMSNorm + SwiGLU; then with
    experts olmoe for q/k norms across heads, qwen2_moe for a shared expert, qwen3_moe for q/k norms, else mixtral; without, qwen3 for q/k norms, qwen2 for biases on q/k/v alone,
    mistral for a sliding window, else llama."""
    if gpt_neox_shaped(arch.norm, arch.activation):
        return "gpt_neox"
    if arch.moe:
        if arch.qk_layernorm_across_heads:
            return "olmoe"
        if arch.moe_shared_expert_intermediate_size:
            return "qwen2_moe"
        return "qwen3_moe" if arch.qk_layernorm else "mixtral"
    if arch.qk_layernorm:
        return "qwen3"
    if arch.add_qkv_bias and not arch.bias_in_attn_linear:
        return "qwen2"
    return "mistral" if arch.sliding_window_width is not None else "llama"


def variants_in_force(arch: Architecture) -> list[str]:
    """The options of the architecture that change the function away from the plain one, in words."""
    found = []
    if arch.num_kv_heads != arch.num_attention_heads:
        found.append(f"grouped-query attention ({arch.num_kv_heads} key/value heads)")
    if arch.head_dim * arch.num_attention_heads != arch.hidden_size:
        found.append(f"heads {arch.head_dim} wide (kv_channels; hidden_size / heads is "
                     f"{arch.hidden_size / arch.num_attention_heads:g})")
    if arch.pos_emb == "rotary" and arch.rope_scaling is not None:
        parameters = ", ".join(f"{k} {v}" for k, v in arch.rope_scaling.items() if k != "rope_type")
        found.append(f"RoPE scaling {arch.rope_scaling['rope_type']} ({parameters})")
    if arch.sliding_window_width is not None:
        found.append(f"sliding window: {arch.sliding_window_width} keys back")
    if arch.qk_layernorm:
        found.append("per-head query/key norm (qk_layernorm)")
    if arch.qk_layernorm_across_heads:
        found.append("query/key norm across heads (qk_layernorm_across_heads)")
    if arch.add_qkv_bias and not arch.bias_in_attn_linear:
        found.append("biases on q/k/v only (add_qkv_bias)")
    if arch.moe:
        layers = "every layer" if arch.moe_expert_interval == 1 else f"every {arch.moe_expert_interval}th layer from 0"
        found.append(f"mixture of experts: {arch.moe_num_experts} experts {arch.moe_intermediate_size} wide in "
                     f"{layers}, top {arch.moe_top_k}{' renormalised' if arch.moe_norm_topk_prob else ''}"
                     + (f", a gated shared expert {arch.moe_shared_expert_intermediate_size} wide"
                        if arch.moe_shared_expert_intermediate_size else ""))
    return found


def describe_model(arch: Architecture, family: str | None = None) -> str:
    """One line for the load plan and inspect_checkpoint.py: the family and the variants in force."""
    variants = variants_in_force(arch)
    return f"{family or implied_family(arch)}, {'; '.join(variants) if variants else 'no variants'}"


def tensor_parallel_split_problem(tp: int, heads: int, kv_heads: int, intermediate_size: int) -> str | None:
    """Why the model cannot be split over ``tp`` tensor-parallel ranks, or None when it can.

    ``intermediate_size`` is the MLP width per projection as built. Fewer key/value heads than ranks
    are replicated, so ``kv_heads`` need only divide ``tp`` or be divisible by it.
    """
    for name, value in (("num_attention_heads", heads), ("intermediate_size", intermediate_size)):
        if value % tp:
            return (f"{name}={value}{' (the MLP width as built)' if name == 'intermediate_size' else ''} is not "
                    f"divisible by model_parallel_size={tp}; each tensor-parallel rank holds an equal share of it, "
                    f"so choose a model_parallel_size that divides {value}")
    if kv_heads % tp and tp % kv_heads:
        return (f"num_kv_heads={kv_heads} neither divides nor is divisible by model_parallel_size={tp}; each "
                f"tensor-parallel rank holds an equal share of the key/value heads, or one head shared with its "
                f"neighbours when there are fewer heads than ranks, so choose a model_parallel_size that "
                f"{kv_heads} divides or that divides {kv_heads}")
    return None


def rope_scaling_of(value: Any) -> dict[str, Any] | None:
    """``rope_scaling`` checked and in one form (numbers as floats, the original length an integer);
    ModelConfigError naming what is wrong."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ModelConfigError(f"rope_scaling={value!r} must be a mapping such as {{rope_type: llama3, factor: 8.0, ...}}")
    rope_type = value.get("rope_type", value.get("type"))
    if rope_type == "dynamic":
        raise ModelConfigError(
            "rope_scaling rope_type 'dynamic' changes the rotary frequencies with each input's length, at inference "
            "only; a model trained with it would depend on the batch's length, so it is not supported for training: "
            "fine-tune with plain rotary (drop rope_scaling) or a fixed scaling (linear, yarn)")
    if rope_type not in ROPE_SCALING_KEYS:
        raise ModelConfigError(f"rope_scaling rope_type {rope_type!r} is not supported; use one of "
                               f"{', '.join(ROPE_SCALING_KEYS)} (or leave rope_scaling unset for plain rotary)")
    required, optional = ROPE_SCALING_KEYS[rope_type]
    given = {k: v for k, v in value.items() if k not in ("rope_type", "type") and v is not None}
    missing = [key for key in required if key not in given]
    unknown = sorted(set(given) - set(required) - set(optional))
    if missing or unknown:
        raise ModelConfigError(
            f"rope_scaling of rope_type {rope_type!r}: "
            + "; ".join(part for part in (missing and f"{', '.join(missing)} missing",
                                          unknown and f"{', '.join(unknown)} not known") if part)
            + f"; it takes {', '.join(required + optional)}")
    resolved: dict[str, Any] = {"rope_type": rope_type}
    for key, number in given.items():
        kind = int if key in _ROPE_SCALING_INTEGERS else bool if key in _ROPE_SCALING_BOOLEANS else float
        if kind is bool:
            ok = isinstance(number, bool)
        else:
            ok = isinstance(number, (int, float)) and not isinstance(number, bool) and number > 0 \
                and (kind is float or number == int(number))
        if not ok:
            raise ModelConfigError(f"rope_scaling.{key}={number!r} must be "
                                   f"{'true or false' if kind is bool else 'a positive ' + ('integer' if kind is int else 'number')}")
        resolved[key] = kind(number)
    return resolved


def _require_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ModelConfigError(f"model setting {name}={value!r} is not supported; use one of {', '.join(choices)}")


def _require_positive_int(name: str, value: Any, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"model setting {name}={value!r} must be a positive integer{hint}")


def architecture_from_settings(values: Mapping[str, Any]) -> Architecture:
    """Validate the model settings in ``values`` (every model setting present) and resolve them into an Architecture."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        _require_positive_int(name, values.get(name))
    _require_positive_int(
        "padded_vocab_size", values.get("padded_vocab_size"),
        "; the caller sets it from the tokenizer's vocabulary padded to make_vocab_size_divisible_by",
    )
    for name, choices in (("norm", NORMS), ("activation", ACTIVATIONS), ("pos_emb", POSITION_EMBEDDINGS),
                          ("init_method", INIT_METHODS), ("output_layer_init_method", INIT_METHODS)):
        _require_choice(name, values.get(name), choices)
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if values.get("kv_channels") is not None:
        _require_positive_int("kv_channels", values["kv_channels"])
    elif hidden % heads:
        raise ModelConfigError(
            f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
            "choose sizes so that every head has the same width, or set each head's width with kv_channels"
        )
    if values.get("intermediate_size") is not None:
        _require_positive_int("intermediate_size", values["intermediate_size"])
    _require_positive_int("mlp_multiple_of", values.get("mlp_multiple_of"))
    fields = _fields(values)
    kv_heads = fields["num_kv_heads"]
    _require_positive_int("num_kv_heads", kv_heads)
    if kv_heads > heads or heads % kv_heads:
        raise ModelConfigError(
            f"num_kv_heads={kv_heads} must divide num_attention_heads={heads} "
            "(each key/value head serves the same number of query heads)"
        )
    if fields["pos_emb"] == "learned":
        _require_positive_int("max_position_embeddings", fields["max_position_embeddings"],
                              " for learned position embeddings; set it or seq_length")
    if fields["pos_emb"] == "rotary":
        pct = fields["rotary_pct"]
        if not 0 < pct <= 1:
            raise ModelConfigError(f"rotary_pct={pct} must lie in (0, 1]")
        head_dim = fields["kv_channels"]
        rotary_ndims = int(head_dim * pct)
        if rotary_ndims < 2 or rotary_ndims % 2:
            raise ModelConfigError(
                f"rotary_pct={pct} of head width {head_dim} gives {rotary_ndims} "
                "rotary dimensions; rotary embedding needs an even number of at least 2"
            )
    fields["rope_scaling"] = rope_scaling_of(None if fields["rope_scaling"] is _MISSING else fields["rope_scaling"])
    if fields["rope_scaling"] is not None and fields["pos_emb"] != "rotary":
        raise ModelConfigError(f"rope_scaling is set but pos_emb={fields['pos_emb']!r}; it scales rotary embedding only")
    if fields["sliding_window_width"] is _MISSING:
        fields["sliding_window_width"] = None
    if fields["sliding_window_width"] is not None:
        _require_positive_int("sliding_window_width", fields["sliding_window_width"])
    tp = fields["model_parallel_size"]
    problem = tensor_parallel_split_problem(tp, heads, kv_heads, fields["intermediate_size"])
    if problem is None and fields["vocab_size"] % tp:
        problem = (f"padded_vocab_size={fields['vocab_size']} is not divisible by model_parallel_size={tp}; the "
                   "vocabulary is padded to a multiple of make_vocab_size_divisible_by x model_parallel_size")
    if problem:
        raise ModelConfigError(problem)
    for problem_of in (query_key_norm_problem, mixture_of_experts_problem):
        setting_problem = problem_of(values)
        if setting_problem:
            raise ModelConfigError(f"{setting_problem[0]}: {setting_problem[1]}")
    missing = [name for name, value in fields.items() if value is _MISSING and name != "max_position_embeddings"]
    if missing:
        raise ModelConfigError(f"model settings {', '.join(missing)} are not set; the model cannot be built without them")
    if fields["max_position_embeddings"] is _MISSING:
        fields["max_position_embeddings"] = None
    return Architecture(**fields)
