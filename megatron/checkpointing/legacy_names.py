"""Parameter names of older GPT-NeoX checkpoints, translated to the current ones."""

from __future__ import annotations

_RENAMED_MLP = {
    "mlp.dense_h_to_4h.": "mlp.linear1.",
    "mlp.dense_4h_to_h.": "mlp.linear2.",
}

# GPT-NeoX stored rotary frequencies as a persistent buffer; this model computes them from the settings.
_BUFFERS_NOT_STORED = ("attention.rotary_emb.inv_freq",)


def translate_legacy_key(name: str) -> str:
    """``...mlp.dense_h_to_4h.weight`` -> ``...mlp.linear1.weight`` (and dense_4h_to_h -> linear2); others unchanged."""
    for old, new in _RENAMED_MLP.items():
        if old in name:
            return name.replace(old, new)
    return name


def is_legacy_buffer_key(name: str) -> bool:
    """True for GPT-NeoX checkpoint entries that are computed buffers here (drop them before a strict load)."""
    return name.endswith(_BUFFERS_NOT_STORED)
