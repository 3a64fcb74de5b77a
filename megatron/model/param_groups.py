"""Which parameters the optimizer exempts from weight decay."""

from __future__ import annotations

import torch

from megatron.model.norms import NORM_TYPES


def no_weight_decay_param_names(model: torch.nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of every bias and every norm weight/scale."""
    names = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            if isinstance(module, NORM_TYPES) or param_name == "bias":
                names.add(f"{module_name}.{param_name}" if module_name else param_name)
    return names
