"""LoRA's settings resolved (PEFT's meanings), and the Hugging Face module names our layers answer to.

A target is named as PEFT names the module of the HF model (``q_proj``, ``query_key_value``, ...).
Some of our layers fuse several HF modules: Llama's q, k and v projections are our
``attention.query_key_value``, its up and gate projections our ``mlp.linear1``. A target on such a
module adapts its part of the fused layer's output with an adapter pair of its own, exactly as
PEFT's adapter on the separate HF module does (megatron/model/lora.py).

The experts of a mixture-of-experts model are no linear modules in transformers (5.x): each layer's
``mlp.experts`` holds its experts' projections as two 3-D parameters, ``gate_up_proj`` [experts, 2 x width,
hidden] (gate then up) and ``down_proj`` [experts, hidden, width], which PEFT adapts through
``target_parameters``. Named here ``experts.gate_up_proj`` and ``experts.down_proj`` (as a PEFT user targets
them), each gives every expert an adapter pair of its own over that expert's slice of the parameter; on such
a model the dense MLP's names (``gate_proj``...) name nothing, and ``all-linear`` is the attention's
projections, as PEFT's is (it adapts nn.Linear modules only). A GPT-NeoX-shaped model with experts (no HF
family has its ungated experts) adapts its attention only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.contract.architecture import ModelConfigError, gpt_neox_shaped

LORA_SETTINGS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_use_rslora")
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer of the blocks (not the output layer)


@dataclass(frozen=True)
class LoraTarget:
    linear: str  # our layer, under a transformer layer
    part: str | None = None  # the part of its output the HF module computes; None: all of it
    experts: bool = False  # the name is an expert parameter (PEFT's target_parameters), adapted per expert


_GPT_NEOX_TARGETS = {
    "query_key_value": LoraTarget("attention.query_key_value"),
    "dense": LoraTarget("attention.dense"),
    "dense_h_to_4h": LoraTarget("mlp.linear1"),
    "dense_4h_to_h": LoraTarget("mlp.linear2"),
}
_LLAMA_TARGETS = {
    "q_proj": LoraTarget("attention.query_key_value", "query"),
    "k_proj": LoraTarget("attention.query_key_value", "key"),
    "v_proj": LoraTarget("attention.query_key_value", "value"),
    "o_proj": LoraTarget("attention.dense"),
    "gate_proj": LoraTarget("mlp.linear1", "gate"),
    "up_proj": LoraTarget("mlp.linear1", "up"),
    "down_proj": LoraTarget("mlp.linear2"),
}
_EXPERT_TARGETS = {
    "experts.gate_up_proj": LoraTarget("mlp.experts.mlp", experts=True),
    "experts.down_proj": LoraTarget("mlp.experts.mlp", experts=True),
}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def target_of(name: str) -> LoraTarget:
    """Our layer and part of the HF module ``name`` of either family (the names do not overlap)."""
    return {**_GPT_NEOX_TARGETS, **_LLAMA_TARGETS, **_EXPERT_TARGETS}[name]


def adapter_key(name: str) -> str:
    """The key of target ``name``'s adapters under their layer: the parameter's own name for an expert target."""
    return name.rpartition(".")[2]


def expert_target_of(peft_name: str) -> str | None:
    """Our expert target for a name of PEFT's target_parameters ('gate_up_proj', 'mlp.experts.down_proj', ...)."""
    return next((name for name in _EXPERT_TARGETS if f".{peft_name}".endswith(f".{adapter_key(name)}")), None)


def _known_targets(gpt_neox: bool, experts: bool) -> dict[str, LoraTarget]:
    """The targets a model of the family has, in the model's order: with experts, the attention's and the experts'."""
    if gpt_neox:  # its experts (not gated) are no HF model's: the attention's targets only
        return {name: _GPT_NEOX_TARGETS[name] for name in ("query_key_value", "dense")} if experts else _GPT_NEOX_TARGETS
    if experts:
        return {**{name: _LLAMA_TARGETS[name] for name in _ATTENTION}, **_EXPERT_TARGETS}
    return _LLAMA_TARGETS


# PEFT's own choice when target_modules is not given (peft.utils.constants, for gpt_neox and the Llama family)
_PEFT_DEFAULT_TARGETS = {True: ("query_key_value",), False: ("q_proj", "v_proj")}


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]  # PEFT's names, in the model's order
    use_rslora: bool
    gpt_neox: bool  # the model is of GPT-NeoX's family (else Llama's): which names the targets are
    experts: bool = False  # the model has experts in place of its MLP (moe_num_experts > 1)

    @property
    def scaling(self) -> float:
        """PEFT's factor of the adapter's output: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def targets(self) -> dict[str, LoraTarget]:
        """Each target's HF name -> our layer and part."""
        table = _known_targets(self.gpt_neox, self.experts)
        return {name: table[name] for name in self.target_modules}

    @property
    def adapts_experts(self) -> bool:
        return any(target.experts for target in self.targets().values())


def target_modules_of(value: str | list[str] | None, gpt_neox: bool, experts: bool = False) -> tuple[str, ...]:
    """The targets ``lora_target_modules`` names, in the model's order; ModelConfigError for a name the model lacks."""
    table = _known_targets(gpt_neox, experts)
    known = tuple(table)
    if value is None:
        return _PEFT_DEFAULT_TARGETS[gpt_neox]
    names = [value] if isinstance(value, str) else list(value)
    if names == [ALL_LINEAR]:
        return tuple(name for name, target in table.items() if not target.experts)
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        family = ("GPT-NeoX" if gpt_neox else "Llama-family") + (" mixture-of-experts" if experts else "")
        raise ModelConfigError(
            f"{', '.join(map(repr, unknown)) or 'an empty list'} names no linear module of this {family} model; "
            f"use some of {', '.join(known)}, or {ALL_LINEAR!r}")
    return tuple(name for name in known if name in names)


def lora_settings(values: Mapping[str, Any]) -> LoraSettings | None:
    """The LoRA of checked settings (megatron/neox_arguments/derived.py checks them); None when lora_rank is 0."""
    if not values["lora_rank"]:
        return None
    gpt_neox = gpt_neox_shaped(values["norm"], values["activation"])
    experts = (values.get("moe_num_experts") or 1) > 1
    return LoraSettings(
        rank=values["lora_rank"],
        alpha=float(values["lora_alpha"]),
        dropout=float(values["lora_dropout"]),
        target_modules=target_modules_of(values["lora_target_modules"], gpt_neox, experts),
        use_rslora=values["lora_use_rslora"],
        gpt_neox=gpt_neox,
        experts=experts,
    )


def target_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, mlp_width: int,
                  expert_width: int = 0) -> dict[str, tuple[int, int]]:
    """Each target's (output, input) width in the whole model, as the HF module has it (a fused layer's part
    included; one expert's slice of an expert parameter): what an adapter of it maps between."""
    query, key_value = heads * head_dim, kv_heads * head_dim
    return {
        "query_key_value": (query + 2 * key_value, hidden), "dense": (hidden, query),
        "dense_h_to_4h": (mlp_width, hidden), "dense_4h_to_h": (hidden, mlp_width),
        "q_proj": (query, hidden), "k_proj": (key_value, hidden), "v_proj": (key_value, hidden),
        "o_proj": (hidden, query), "gate_proj": (mlp_width, hidden), "up_proj": (mlp_width, hidden),
        "down_proj": (hidden, mlp_width),
        "experts.gate_up_proj": (2 * expert_width, hidden), "experts.down_proj": (hidden, expert_width),
    }
