"""The shape config.json gives each tensor of a Hugging Face folder, so a tensor of another shape is refused
as it is read, naming it, its file and both shapes, before anything is converted or written.

A folder whose weights disagree with its own config would otherwise convert into a corrupt checkpoint (a
router with an extra expert, fused experts of another row count) or end in a broadcast error deep in the
mapping. The names are those of megatron/hf/mapping.py's correspondences; the widths are the Architecture's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from megatron.contract.architecture import Architecture
from megatron.hf.errors import HFConversionError
from megatron.hf.io import CONFIG_NAME

Shape = tuple[int | None, ...]  # None: any length (the vocabulary's rows, which a run may pad otherwise)


def _rules(arch: Architecture) -> list[tuple[re.Pattern, Shape]]:
    """(a pattern of HF tensor names, their shape) for every tensor mapping.py reads."""
    hidden, vocab = arch.hidden_size, None
    query, key_value = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    dense, expert, shared = arch.intermediate_size, arch.moe_intermediate_size, arch.moe_shared_expert_intermediate_size
    fused = query + 2 * key_value
    qk_norm = {"q": query, "k": key_value} if arch.qk_layernorm_across_heads else {"q": arch.head_dim, "k": arch.head_dim}

    def fixed(*shape: int | None) -> Shape:
        return shape

    rules = [
        (r"(gpt_neox\.embed_in|model\.embed_tokens)\.weight", fixed(vocab, hidden)),
        (r"(embed_out|lm_head)\.weight", fixed(vocab, hidden)),
        (r"score\.weight", fixed(1, hidden)),
        (r".*(layernorm|layer_norm|model\.norm)\.(weight|bias)", fixed(hidden)),
        (r".*\.attention\.query_key_value\.weight", fixed(fused, hidden)),
        (r".*\.attention\.query_key_value\.bias", fixed(fused)),
        (r".*\.attention\.dense\.weight", fixed(hidden, query)),
        (r".*\.mlp\.dense_h_to_4h\.weight", fixed(dense, hidden)),
        (r".*\.mlp\.dense_h_to_4h\.bias", fixed(dense)),
        (r".*\.mlp\.dense_4h_to_h\.weight", fixed(hidden, dense)),
        (r".*\.self_attn\.q_proj\.weight", fixed(query, hidden)),
        (r".*\.self_attn\.q_proj\.bias", fixed(query)),
        (r".*\.self_attn\.[kv]_proj\.weight", fixed(key_value, hidden)),
        (r".*\.self_attn\.[kv]_proj\.bias", fixed(key_value)),
        (r".*\.self_attn\.o_proj\.weight", fixed(hidden, query)),
        *((rf".*\.self_attn\.{x}_norm\.weight", fixed(width)) for x, width in qk_norm.items()),
        (r".*\.(attention\.dense|self_attn\.o_proj|mlp\.dense_4h_to_h|mlp\.down_proj)\.bias", fixed(hidden)),
        (r".*\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight", fixed(expert, hidden)),
        (r".*\.experts\.\d+\.(down_proj|w2)\.weight", fixed(hidden, expert)),
        (r".*\.(block_sparse_moe|mlp)\.gate\.weight", fixed(arch.moe_num_experts, hidden)),
        (r".*\.mlp\.shared_expert\.(gate_proj|up_proj)\.weight", fixed(shared, hidden)),
        (r".*\.mlp\.shared_expert\.down_proj\.weight", fixed(hidden, shared)),
        (r".*\.mlp\.shared_expert_gate\.weight", fixed(1, hidden)),
        (r".*\.mlp\.(gate_proj|up_proj)\.weight", fixed(dense, hidden)),
        (r".*\.mlp\.(gate_proj|up_proj)\.bias", fixed(dense)),
        (r".*\.mlp\.down_proj\.weight", fixed(hidden, dense)),
    ]
    return [(re.compile(pattern), shape) for pattern, shape in rules]


def expected_shapes(arch: Architecture) -> Callable[[str], Shape | None]:
    """The shape the config gives the HF tensor `name`; None for a name of no rule (mapping.py refuses those)."""
    rules = _rules(arch)

    def shape_of(name: str) -> Shape | None:
        return next((shape for pattern, shape in rules if pattern.fullmatch(name)), None)

    return shape_of


def shape_fits(shape: tuple[int, ...], expected: Shape) -> bool:
    return len(shape) == len(expected) and all(want is None or have == want for have, want in zip(shape, expected, strict=True))


def shape_check(arch: Architecture) -> Callable[[Path, str, torch.Tensor], None]:
    """A check of each tensor as it is read (io.iter_hf_tensors' `check`): HFConversionError in one line naming the
    tensor, its file, its shape and the one the config gives."""
    shape_of = expected_shapes(arch)

    def check(shard: Path, name: str, tensor: torch.Tensor) -> None:
        expected = shape_of(name)
        if expected is not None and not shape_fits(tuple(tensor.shape), expected):
            wanted = "(" + ", ".join("any" if size is None else str(size) for size in expected) + \
                (",)" if len(expected) == 1 else ")")
            raise HFConversionError(
                f"{shard}: {name} has shape {tuple(tensor.shape)}, but {CONFIG_NAME} beside it gives {wanted}; the "
                f"weights do not belong to this config: fix the config or restore the weights")

    return check
