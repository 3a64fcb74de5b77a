"""The one mapping between Hugging Face parameter names and ours, in both directions.

Ours are GPT-NeoX's sequential names (see megatron/model/gpt_model.py). Each ``Correspondence``
pairs a tuple of HF tensors with a tuple of ours and knows how to turn one side into the other:
Llama's separate q/k/v projections become our fused ``query_key_value`` and its gate/up
projections our ``mlp.linear1`` (up first, then gate); GPT-NeoX's names differ only in the prefix.
Mistral, Qwen2 and Qwen3 name their weights as Llama does; Qwen3's ``q_norm``/``k_norm`` are our
``attention.q_layernorm``/``k_layernorm``. The experts of Mixtral (``block_sparse_moe.experts.<e>.w1`` gate,
``w3`` up, ``w2`` down) and Qwen2-MoE, Qwen3-MoE and OLMoE (``mlp.experts.<e>.gate_proj``, ``up_proj``, ``down_proj``), as
save_pretrained writes them (transformers 5 fuses them in memory only), are stacked into our
``mlp.experts.mlp.w1``, ``w3`` and ``w2`` (the down projections transposed); their ``gate`` is our
``mlp.router.layer``. Qwen2-MoE's ``mlp.shared_expert`` (a dense MLP) is our ``mlp.shared_expert.mlp`` and its
``mlp.shared_expert_gate`` ours. OLMoE's ``q_norm``/``k_norm`` span all heads; they map as Qwen3's. A reward model's ``rm_linear`` is the sequence classifier's ``score``.

Conversion streams: tensors may arrive in any order, one shard at a time, and a correspondence
is converted as soon as all of its source tensors have arrived.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megatron.checkpointing import is_legacy_buffer_key, translate_legacy_key
from megatron.contract.architecture import Architecture
from megatron.hf.config import FAMILIES, LLAMA_LIKE
from megatron.hf.errors import HFConversionError
from megatron.model.attention import query_key_value_rows
from megatron.model.gpt_model import layer_key
from megatron.model.weight_values import untrainable_weight

Convert = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _same(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return tensors


@dataclass(frozen=True)
class Correspondence:
    hf: tuple[str, ...]
    ours: tuple[str, ...]
    to_ours: Convert = _same
    to_hf: Convert = _same


@dataclass(frozen=True)
class Direction:
    """Which side is read: the rules, and how to treat source names that are no current parameter names."""

    name: str  # "hf_to_ours" or "ours_to_hf"
    rules: tuple[tuple[tuple[str, ...], tuple[str, ...], Convert], ...]  # (sources, targets, convert)
    is_ignored: Callable[[str], bool]  # computed buffers some checkpoints store
    canonical: Callable[[str], str]  # an older name of a source tensor -> its current name


def _qkv_converters(arch: Architecture) -> tuple[Convert, Convert]:
    """fuse(q, k, v) -> [qkv] and split([qkv]) -> [q, k, v] in our layout (weights and biases alike)."""
    rows = query_key_value_rows(arch)

    def fuse(parts):
        fused = parts[0].new_empty((sum(len(r) for r in rows), *parts[0].shape[1:]))
        for part_rows, part in zip(rows, parts, strict=True):
            fused[part_rows] = part
        return [fused]

    def split(fused):
        return [fused[0][part_rows] for part_rows in rows]

    return fuse, split


def _cat_up_gate(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(parts, dim=0)]


def _split_up_gate(fused: list[torch.Tensor]) -> list[torch.Tensor]:
    return [part.clone() for part in fused[0].chunk(2, dim=0)]


def _stack(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(parts, dim=0)]


def _unstack(count: int) -> Convert:
    def unstack(stacked: list[torch.Tensor]) -> list[torch.Tensor]:
        return [part.clone() for part in stacked[0].chunk(count, dim=0)]
    return unstack


def _stack_transposed(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat([part.t() for part in parts], dim=0)]


def _unstack_transposed(count: int) -> Convert:
    def unstack(stacked: list[torch.Tensor]) -> list[torch.Tensor]:
        return [part.t().contiguous() for part in stacked[0].chunk(count, dim=0)]
    return unstack


def _expert_correspondences(family: str, arch: Architecture, hf: str, ours: str) -> list[Correspondence]:
    """A mixture-of-experts layer's router and experts (see the module docstring)."""
    block, (gate, up, down) = ((f"{hf}block_sparse_moe.", ("w1", "w3", "w2")) if family == "mixtral"
                               else (f"{hf}mlp.", ("gate_proj", "up_proj", "down_proj")))
    experts = range(arch.moe_num_experts)

    def each(name: str) -> tuple[str, ...]:
        return tuple(f"{block}experts.{e}.{name}.weight" for e in experts)

    count = arch.moe_num_experts
    rules = [
        Correspondence((f"{block}gate.weight",), (f"{ours}mlp.router.layer.weight",)),
        Correspondence(each(gate), (f"{ours}mlp.experts.mlp.w1",), _stack, _unstack(count)),
        Correspondence(each(up), (f"{ours}mlp.experts.mlp.w3",), _stack, _unstack(count)),
        Correspondence(each(down), (f"{ours}mlp.experts.mlp.w2",), _stack_transposed, _unstack_transposed(count)),
    ]
    if arch.moe_shared_expert_intermediate_size:
        rules += [*_dense_mlp_correspondences(f"{hf}mlp.shared_expert.", f"{ours}mlp.shared_expert.mlp.", ("weight",)),
                  Correspondence((f"{hf}mlp.shared_expert_gate.weight",), (f"{ours}mlp.shared_expert_gate.weight",))]
    return rules


def _dense_mlp_correspondences(hf: str, ours: str, params: tuple[str, ...]) -> list[Correspondence]:
    """A Llama MLP's gate/up/down projections under ``hf`` and our linear1 (up, then gate) and linear2 under ``ours``."""
    rules = []
    for p in params:
        up_gate = (f"{hf}up_proj.{p}", f"{hf}gate_proj.{p}")
        rules.append(Correspondence(up_gate, (f"{ours}linear1.{p}",), _cat_up_gate, _split_up_gate))
        rules.append(Correspondence((f"{hf}down_proj.{p}",), (f"{ours}linear2.{p}",)))
    return rules


def _ours(arch: Architecture) -> dict[str, str]:
    return {
        "embedding": "sequential.0.word_embeddings.weight",
        "final_norm": f"sequential.{arch.num_layers + 3}.norm.",
        "output": f"sequential.{arch.num_layers + 4}.final_linear.weight",
        "reward_head": f"sequential.{arch.num_layers + 4}.rm_linear.weight",
    }


def _output_correspondence(arch: Architecture, hf_output: str) -> list[Correspondence]:
    """The output layer, or a reward model's head (transformers' `score` of a sequence classifier)."""
    names = _ours(arch)
    if arch.reward_head:
        return [Correspondence(("score.weight",), (names["reward_head"],))]
    return [] if arch.tied_embeddings else [Correspondence((hf_output,), (names["output"],))]


def _gpt_neox_correspondences(arch: Architecture) -> list[Correspondence]:
    names = _ours(arch)
    pairs = [("gpt_neox.embed_in.weight", names["embedding"])]
    attn_params = ("weight", "bias") if arch.bias_in_attn_linear else ("weight",)
    for i in range(arch.num_layers):
        hf, ours = f"gpt_neox.layers.{i}.", f"sequential.{layer_key(i)}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            pairs += [(f"{hf}{norm}.{p}", f"{ours}{norm}.{p}") for p in ("weight", "bias")]
        for linear in ("query_key_value", "dense"):
            pairs += [(f"{hf}attention.{linear}.{p}", f"{ours}attention.{linear}.{p}") for p in attn_params]
        for theirs, mine in (("dense_h_to_4h", "linear1"), ("dense_4h_to_h", "linear2")):
            pairs += [(f"{hf}mlp.{theirs}.{p}", f"{ours}mlp.{mine}.{p}") for p in ("weight", "bias")]
    pairs += [(f"gpt_neox.final_layer_norm.{p}", names["final_norm"] + p) for p in ("weight", "bias")]
    return [Correspondence((hf,), (ours,)) for hf, ours in pairs] + _output_correspondence(arch, "embed_out.weight")


def _llama_correspondences(family: str, arch: Architecture) -> list[Correspondence]:
    names = _ours(arch)
    fuse_qkv, split_qkv = _qkv_converters(arch)
    rules = [Correspondence(("model.embed_tokens.weight",), (names["embedding"],))]
    qkv_params = ("weight", "bias") if arch.qkv_bias else ("weight",)
    dense_params = ("weight", "bias") if arch.bias_in_attn_linear else ("weight",)
    mlp_params = ("weight", "bias") if arch.bias_in_mlp else ("weight",)
    for i in range(arch.num_layers):
        hf, ours = f"model.layers.{i}.", f"sequential.{layer_key(i)}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            rules.append(Correspondence((f"{hf}{norm}.weight",), (f"{ours}{norm}.scale",)))
        for p in qkv_params:
            qkv = tuple(f"{hf}self_attn.{x}_proj.{p}" for x in "qkv")
            rules.append(Correspondence(qkv, (f"{ours}attention.query_key_value.{p}",), fuse_qkv, split_qkv))
        for p in dense_params:
            rules.append(Correspondence((f"{hf}self_attn.o_proj.{p}",), (f"{ours}attention.dense.{p}",)))
        if arch.qk_layernorm or arch.qk_layernorm_across_heads:
            for x in "qk":
                rules.append(Correspondence((f"{hf}self_attn.{x}_norm.weight",), (f"{ours}attention.{x}_layernorm.scale",)))
        if arch.has_experts(i):
            rules += _expert_correspondences(family, arch, hf, ours)
        else:
            rules += _dense_mlp_correspondences(f"{hf}mlp.", f"{ours}mlp.", mlp_params)
    rules.append(Correspondence(("model.norm.weight",), (names["final_norm"] + "scale",)))
    return rules + _output_correspondence(arch, "lm_head.weight")


# The HF module of each linear layer a LoRA target names (megatron/contract/lora_settings.py), under its layer
_LINEAR_MODULES = {
    **{f"{x}_proj": f"self_attn.{x}_proj" for x in "qkvo"},
    **{f"{x}_proj": f"mlp.{x}_proj" for x in ("gate", "up", "down")},
    "query_key_value": "attention.query_key_value", "dense": "attention.dense",
    "dense_h_to_4h": "mlp.dense_h_to_4h", "dense_4h_to_h": "mlp.dense_4h_to_h",
    # transformers (5.x) holds a layer's experts as 3-D parameters of one module, whichever way its files store them
    "experts.gate_up_proj": "mlp.experts", "experts.down_proj": "mlp.experts",
}


def hf_linear_module(family: str, layer: int, name: str) -> str:
    """The HF module a LoRA target ``name`` adapts in layer ``layer``, e.g. model.layers.0.self_attn.q_proj."""
    return f"{'gpt_neox' if family == 'gpt_neox' else 'model'}.layers.{layer}.{_LINEAR_MODULES[name]}"


def correspondences(family: str, arch: Architecture) -> list[Correspondence]:
    if family == "gpt_neox":
        return _gpt_neox_correspondences(arch)
    if family in LLAMA_LIKE:
        return _llama_correspondences(family, arch)
    raise HFConversionError(f"architecture {family!r} is not supported; use one of {', '.join(FAMILIES)}")


# Buffers that some HF checkpoints carry but that are no parameters (recomputed from the config).
_HF_BUFFERS = re.compile(r"(\.rotary_emb\.inv_freq|\.attention\.bias|\.attention\.masked_bias)$")
_HF_OUTPUT_NAMES = {"gpt_neox": ("embed_out.weight", "lm_head.weight")}  # the others: lm_head.weight


def hf_to_ours(family: str, arch: Architecture) -> Direction:
    # with tied embeddings a stored output layer is the embedding again: skip it
    skipped = set(_HF_OUTPUT_NAMES.get(family, ("lm_head.weight",))) if arch.tied_embeddings else set()

    def is_ignored(name: str) -> bool:
        return name in skipped or _HF_BUFFERS.search(name) is not None

    def canonical(name: str) -> str:  # transformers 5 calls GPTNeoX's embed_out lm_head
        return "embed_out.weight" if family == "gpt_neox" and name == "lm_head.weight" else name

    rules = tuple((c.hf, c.ours, c.to_ours) for c in correspondences(family, arch))
    return Direction("hf_to_ours", rules, is_ignored, canonical)


def ours_to_hf(family: str, arch: Architecture) -> Direction:
    rules = tuple((c.ours, c.hf, c.to_hf) for c in correspondences(family, arch))
    return Direction("ours_to_hf", rules, is_legacy_buffer_key, translate_legacy_key)


class StreamingConverter:
    """Feed source tensors in any order; converted tensors come out as soon as their sources are complete."""

    def __init__(self, direction: Direction, source: str):
        self.direction = direction
        self.source = source
        self.rule_of = {name: index for index, rule in enumerate(direction.rules) for name in rule[0]}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.completed: set[int] = set()
        self.unexpected: list[str] = []

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if self.direction.is_ignored(name):
            return []
        name = self.direction.canonical(name)
        index = self.rule_of.get(name)
        if index is None:
            self.unexpected.append(name)
            return []
        problem = untrainable_weight(name, tensor)
        if problem:
            raise HFConversionError(f"{self.source}: {problem}")
        sources, targets, convert = self.direction.rules[index]
        parts = self.pending.setdefault(index, {})
        if name in parts or index in self.completed:
            raise HFConversionError(f"{self.source}: tensor {name!r} appears twice")
        parts[name] = tensor
        if len(parts) < len(sources):
            return []
        del self.pending[index]
        self.completed.add(index)
        return list(zip(targets, convert([parts[s] for s in sources]), strict=True))

    def finish(self) -> None:
        """Raise when a source tensor was unexpected or an expected one never came."""
        missing = [
            name for index, rule in enumerate(self.direction.rules) if index not in self.completed for name in rule[0]
        ]
        missing = [name for name in missing if name not in self.pending.get(self.rule_of[name], {})]
        if self.unexpected or missing:
            raise HFConversionError(
                f"{self.source}: the tensors do not match the architecture in the config; "
                f"missing {_first(missing)}, unexpected {_first(self.unexpected)}. "
                "Check that the config (num_layers, biases, weight tying, family) describes these weights"
            )


def _first(names: list[str], count: int = 5) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - count} more" if len(names) > count else ""
    return ", ".join(names[:count]) + more


def convert_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    direction: Direction,
    source: str,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """All target tensors converted from ``tensors`` (cast to ``dtype`` when given), checked complete."""
    converter = StreamingConverter(direction, source)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        for target, value in converter.add(name, tensor):
            out[target] = value.to(dtype) if dtype is not None else value
    converter.finish()
    return out
