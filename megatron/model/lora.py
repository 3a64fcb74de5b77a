"""LoRA adapters on the model's linear layers, computed as PEFT's (its settings: megatron/lora_settings.py).

Each targeted Hugging Face module gets its own adapter pair: A (r x in, drawn as PEFT draws it) and B
(out x r, zeros, so a fresh adapter leaves the model as it was), adding B A dropout(x) x scaling to
the output. On a layer of ours that fuses several HF modules (q, k and v in ``query_key_value``; up
and gate in ``mlp.linear1``) each adapter adds into the rows of the output its HF module computes.

The adapters of a layer are its child ``lora`` and a forward hook adds their output to the layer's,
so the base's parameter names stay those of its checkpoints. Adding adapters freezes every other
parameter: they get no gradient, so the optimizer holds no state or master copy of them. A reward
model's scalar head is new to the base and trains beside the adapters (PEFT's `modules_to_save` for
its sequence-classification head).

DPO and KTO compare the policy with the base it started from: in a LoRA run that is the policy itself
with its adapters switched off (`BaseWithoutAdapters`), so no second model is held in memory.
"""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from megatron.architecture import Architecture
from megatron.lora_settings import LoraSettings
from megatron.model.attention import query_key_value_rows


class LoraAdapter(torch.nn.Module):
    """One PEFT adapter: B A dropout(x), into ``rows`` of the layer's output (all of it when None)."""

    def __init__(self, in_features: int, out_features: int, rank: int, dropout: float, rows: torch.Tensor | None):
        super().__init__()
        self.lora_A = torch.nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_features, rank))
        self.dropout = dropout
        self.register_buffer("rows", rows, persistent=False)

    def reset_parameters(self) -> None:
        """PEFT's initialisation (LoraLayer.reset_lora_parameters with init_lora_weights True)."""
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        torch.nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(F.dropout(x, self.dropout, self.training), self.lora_A), self.lora_B)


class LinearAdapters(torch.nn.ModuleDict):
    """The adapters of one linear layer, by their HF module's name."""

    def __init__(self, adapters: dict[str, LoraAdapter], scaling: float):
        super().__init__(adapters)
        self.scaling = scaling
        self.switched_on = True

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for adapter in self.values():
            delta = adapter(x) * self.scaling
            out = out + delta if adapter.rows is None else out.index_add(-1, adapter.rows, delta)
        return out


def _add_adapter_output(linear: torch.nn.Module, inputs: tuple, output: tuple) -> tuple:
    if not linear.lora.switched_on:
        return output
    out, bias = output  # megatron-core's linear layers return (output, bias or None)
    return linear.lora(inputs[0], out), bias


@contextmanager
def adapters_switched_off(model: torch.nn.Module):
    """Within the block ``model`` computes as its base, as if it had no adapters."""
    adapters = [module for module in model.modules() if isinstance(module, LinearAdapters)]
    for layer_adapters in adapters:
        layer_adapters.switched_on = False
    try:
        yield
    finally:
        for layer_adapters in adapters:
            layer_adapters.switched_on = True


class BaseWithoutAdapters:
    """The frozen base of a LoRA ``engine``'s model, called as the engine is: its forward in eval mode (as a
    separately built reference runs) with the adapters switched off, without gradients."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, *args, **kwargs):
        module = self.engine.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), adapters_switched_off(module):
                return self.engine(*args, **kwargs)
        finally:
            module.train(was_training)


def _rows_of_parts(arch: Architecture) -> dict[str, torch.Tensor]:
    """The output rows of each part of a fused layer (megatron/model/attention.py and mlp.py lay them out)."""
    query, key, value = query_key_value_rows(arch)
    up = torch.arange(arch.intermediate_size)
    return {"query": query, "key": key, "value": value, "up": up, "gate": up + arch.intermediate_size}


def add_adapters(model: torch.nn.Module, lora: LoraSettings) -> None:
    """Give each transformer layer of ``model`` (a GPTModel) the adapters ``lora`` targets and freeze the rest."""
    model.requires_grad_(False)
    rows_of_part = _rows_of_parts(model.arch)
    by_linear: dict[str, dict[str, str | None]] = defaultdict(dict)
    for name, target in lora.targets().items():
        by_linear[target.linear][name] = target.part
    for layer in model.layers:
        for linear_name, parts in by_linear.items():
            linear = layer.get_submodule(linear_name)
            out_features, in_features = linear.weight.shape
            adapters = {}
            for name, part in parts.items():
                rows = None if part is None else rows_of_part[part]
                width = out_features if rows is None else len(rows)
                adapters[name] = LoraAdapter(in_features, width, lora.rank, lora.dropout, rows)
            linear.lora = LinearAdapters(adapters, lora.scaling)
            linear.register_forward_hook(_add_adapter_output)
    if model.arch.reward_head:
        model.reward_head.requires_grad_(True)


def initialise_adapters(model: torch.nn.Module) -> None:
    """Draw every adapter's weights, in registration order, from the current RNG state."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraAdapter):
                module.reset_parameters()
