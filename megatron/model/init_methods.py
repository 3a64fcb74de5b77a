"""Weight initialisers with GPT-NeoX's semantics (megatron/model/init_functions.py there)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def init_std(method: str, sigma: float, num_layers: int, hidden_size: int) -> float:
    """Standard deviation of the normal distribution that ``method`` draws from."""
    if method == "normal":
        return sigma
    if method == "scaled_normal":
        return sigma / math.sqrt(2.0 * num_layers)
    if method == "small_init":
        return math.sqrt(2.0 / (5.0 * hidden_size))
    if method == "wang_init":
        return 2.0 / (num_layers * math.sqrt(hidden_size))
    raise ValueError(f"unknown init method {method!r}")


def normal_init(std: float) -> InitMethod:
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_
