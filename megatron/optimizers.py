"""Optimizer parameter groups: weight decay on weight matrices and embeddings, none on biases and norms."""

from __future__ import annotations

import torch

from megatron.model import no_weight_decay_param_names


def build_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    exempt = no_weight_decay_param_names(model)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in trainable if name not in exempt], "weight_decay": weight_decay}]
    no_decay = [p for name, p in trainable if name in exempt]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
