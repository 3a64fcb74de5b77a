"""Parameter names of older GPT-NeoX checkpoints, translated to the current ones."""

from __future__ import annotations

from collections.abc import Mapping

import torch

_RENAMED_MLP = {
    "mlp.dense_h_to_4h.": "mlp.linear1.",
    "mlp.dense_4h_to_h.": "mlp.linear2.",
    "mlp.w2.": "mlp.linear2.",  # the Llama MLP's output projection
}
# The Llama MLP computed silu(w1(x)) * w3(x): w3 is the up and w1 the gate projection, which linear1 holds
# stacked, up first (per tensor-parallel partition, as each checkpoint shard holds them).
_GATED_UP, _GATED_GATE = "mlp.w3.weight", "mlp.w1.weight"

# GPT-NeoX stored rotary frequencies as a persistent buffer; this model computes them from the settings.
_BUFFERS_NOT_STORED = ("attention.rotary_emb.inv_freq",)


def translate_legacy_key(name: str) -> str:
    """``...mlp.dense_h_to_4h.weight`` -> ``...mlp.linear1.weight`` (dense_4h_to_h and w2 -> linear2); others unchanged."""
    for old, new in _RENAMED_MLP.items():
        if old in name:
            return name.replace(old, new)
    return name


def is_legacy_buffer_key(name: str) -> bool:
    """True for GPT-NeoX checkpoint entries that are computed buffers here (drop them before a strict load)."""
    return name.endswith(_BUFFERS_NOT_STORED)


def is_legacy_key(name: str) -> bool:
    """True for a stored name that translate_legacy_module renames, merges or drops."""
    return is_legacy_buffer_key(name) or translate_legacy_key(name) != name or name.endswith((_GATED_UP, _GATED_GATE))


def translate_legacy_module(module: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole state dict with the current names: renamed MLP keys, stored buffers dropped, and the Llama
    MLP's separate w3 (up) and w1 (gate) stacked into linear1. A w1 or w3 without its partner stays as it is."""
    translated: dict[str, torch.Tensor] = {}
    gated: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in module.items():
        if is_legacy_buffer_key(name):
            continue
        part = next((suffix for suffix in (_GATED_UP, _GATED_GATE) if name.endswith(suffix)), None)
        if part is not None:
            gated.setdefault(name[: -len(part)], {})[part] = tensor
        else:
            translated[translate_legacy_key(name)] = tensor
    for prefix, parts in gated.items():
        if len(parts) == 2:
            translated[f"{prefix}mlp.linear1.weight"] = torch.cat([parts[_GATED_UP], parts[_GATED_GATE]])
        else:
            translated.update({prefix + part: tensor for part, tensor in parts.items()})
    return translated
