"""Shared by the settings tests: a small valid run config and a way to write YAML files."""

from __future__ import annotations

from pathlib import Path

import yaml

TINY_RUN = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "train_iters": 100,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    "train_micro_batch_size_per_gpu": 2,
    "embedded_corpus": True,
}


def write_yaml(directory: Path, name: str, values: dict | str) -> Path:
    path = directory / name
    path.write_text(values if isinstance(values, str) else yaml.safe_dump(values, sort_keys=False))
    return path
