"""The model's shape and options, resolved once from the settings into plain values.

Validated settings already carry derived sizes; settings restored without validation (saved by
another program, or built field by field) get the same defaults through the settings layer's rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.model.errors import ModelConfigError
from megatron.neox_arguments.derived import default_intermediate_size, tensor_parallel_split_problem

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "relu", "silu", "swiglu")
POSITION_EMBEDDINGS = ("learned", "rotary", "none")
INIT_METHODS = ("normal", "small_init", "wang_init", "scaled_normal")


@dataclass(frozen=True)
class Architecture:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
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
    bias_in_norms: bool
    bias_in_attn_linear: bool
    bias_in_mlp: bool
    hidden_dropout: float
    attention_dropout: float
    init_method: str
    output_layer_init_method: str
    init_method_std: float
    checkpoint_activations: bool
    sliding_window_width: int | None = None  # Mistral: keys at most this many positions back, and the query's own

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_ndims(self) -> int:
        return int(self.head_dim * self.rotary_pct) if self.pos_emb == "rotary" else 0


def derive_size_defaults(args: Any) -> dict[str, int | None]:
    """num_kv_heads, intermediate_size and max_position_embeddings, with GPT-NeoX's rules for unset ones."""
    num_kv_heads = args.num_kv_heads if args.num_kv_heads is not None else args.num_attention_heads
    intermediate_size = args.intermediate_size
    if intermediate_size is None:
        intermediate_size = default_intermediate_size(args.hidden_size, args.activation, args.mlp_multiple_of)
    max_positions = args.max_position_embeddings
    if max_positions is None:
        max_positions = args.seq_length
    return {
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_positions,
    }


def _require_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ModelConfigError(
            f"model setting {name}={value!r} is not supported; use one of {', '.join(choices)}"
        )


def _require_positive_int(name: str, value: Any, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"model setting {name}={value!r} must be a positive integer{hint}")


def _require_tensor_parallel_split(tp: int, heads: int, kv_heads: int, intermediate_size: int, vocab: int) -> None:
    problem = tensor_parallel_split_problem(tp, heads, kv_heads, intermediate_size)
    if problem is None and vocab % tp:
        problem = (f"padded_vocab_size={vocab} is not divisible by model_parallel_size={tp}; the vocabulary "
                   "is padded to a multiple of make_vocab_size_divisible_by x model_parallel_size")
    if problem:
        raise ModelConfigError(problem)


def architecture_from_args(args: Any) -> Architecture:
    """Validate the model settings of ``args`` (a NeoXArgs) and resolve them into an Architecture."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        _require_positive_int(name, getattr(args, name))
    _require_positive_int(
        "padded_vocab_size",
        args.padded_vocab_size,
        "; the caller sets it from the tokenizer's vocabulary padded to make_vocab_size_divisible_by",
    )
    for name, choices in (
        ("norm", NORMS),
        ("activation", ACTIVATIONS),
        ("pos_emb", POSITION_EMBEDDINGS),
        ("init_method", INIT_METHODS),
        ("output_layer_init_method", INIT_METHODS),
    ):
        _require_choice(name, getattr(args, name), choices)

    sizes = derive_size_defaults(args)
    heads, kv_heads = args.num_attention_heads, sizes["num_kv_heads"]
    if args.hidden_size % heads:
        raise ModelConfigError(
            f"hidden_size={args.hidden_size} is not divisible by num_attention_heads={heads}; "
            "choose sizes so that every head has the same width"
        )
    _require_positive_int("num_kv_heads", kv_heads)
    if kv_heads > heads or heads % kv_heads:
        raise ModelConfigError(
            f"num_kv_heads={kv_heads} must divide num_attention_heads={heads} "
            "(each key/value head serves the same number of query heads)"
        )
    _require_positive_int("intermediate_size", sizes["intermediate_size"])
    if args.pos_emb == "learned":
        _require_positive_int(
            "max_position_embeddings",
            sizes["max_position_embeddings"],
            " for learned position embeddings; set it or seq_length",
        )
    if args.pos_emb == "rotary":
        if not 0 < args.rotary_pct <= 1:
            raise ModelConfigError(f"rotary_pct={args.rotary_pct} must lie in (0, 1]")
        rotary_ndims = int(args.hidden_size // heads * args.rotary_pct)
        if rotary_ndims < 2 or rotary_ndims % 2:
            raise ModelConfigError(
                f"rotary_pct={args.rotary_pct} of head width {args.hidden_size // heads} gives {rotary_ndims} "
                "rotary dimensions; rotary embedding needs an even number of at least 2"
            )
    _require_tensor_parallel_split(getattr(args, "model_parallel_size", 1) or 1, heads, kv_heads,
                                   sizes["intermediate_size"], args.padded_vocab_size)

    norm_epsilon = args.layernorm_epsilon if args.norm == "layernorm" else args.rms_norm_epsilon
    return Architecture(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=sizes["intermediate_size"],
        vocab_size=args.padded_vocab_size,
        max_position_embeddings=sizes["max_position_embeddings"],
        pos_emb=args.pos_emb,
        rotary_pct=float(args.rotary_pct),
        rotary_emb_base=float(args.rotary_emb_base),
        tied_embeddings=not args.no_weight_tying,
        parallel_residual=bool(args.gpt_j_residual),
        norm=args.norm,
        norm_epsilon=float(norm_epsilon),
        activation=args.activation,
        bias_in_norms=bool(args.use_bias_in_norms),
        bias_in_attn_linear=bool(args.use_bias_in_attn_linear),
        bias_in_mlp=bool(args.use_bias_in_mlp),
        hidden_dropout=float(args.hidden_dropout),
        attention_dropout=float(args.attention_dropout),
        init_method=args.init_method,
        output_layer_init_method=args.output_layer_init_method,
        init_method_std=float(args.init_method_std),
        checkpoint_activations=bool(args.checkpoint_activations),
        sliding_window_width=_sliding_window_width(args),
    )


def _sliding_window_width(args: Any) -> int | None:
    width = getattr(args, "sliding_window_width", None)
    if width is not None:
        _require_positive_int("sliding_window_width", width)
    return width
