"""Optimizer parameter groups: weight decay on weight matrices, none on biases and norm weights."""

from __future__ import annotations

import torch


def is_no_decay_parameter(name: str, param: torch.nn.Parameter) -> bool:
    """Biases and normalisation weights (1-D tensors) are not decayed; embeddings and matrices are."""
    return name.endswith(".bias") or param.ndim < 2


def build_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if is_no_decay_parameter(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
