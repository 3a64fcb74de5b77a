"""Weight initialisers with GPT-NeoX's semantics (megatron/model/init_functions.py there)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megatron.contract.architecture import Architecture
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.model.partitioning import (
    INITIALISED_WEIGHTS,
    OUTPUT_WEIGHTS,
    PARALLEL_BIASES,
    Partitioning,
    partition,
    partitioning,
)
from megatron.model.zero3_partition import is_partitioned, write_whole_value

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


def initialise_parameters(
    model: torch.nn.Module, arch: Architecture, init_method: InitMethod, output_init_method: InitMethod, rank: int, size: int
) -> None:
    """Draw the weights of ``model`` (built without initialisation) as a pure function of the RNG state.

    Each weight is drawn whole in fp32, in registration order, then this rank keeps its part: every
    tensor-parallel size and every ZeRO-3 partitioning gives the same full model, and size 1 the same
    draws as a plain build. Only one whole weight exists at a time. Biases of split layers start at
    zero; norms keep the ones/zeros their modules made. Split parameters get megatron-core's
    tensor-parallel attributes, which DeepSpeed's gradient norm reads.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            p = partitioning(name, arch)
            if name.endswith(INITIALISED_WEIGHTS):
                full = torch.empty(full_shape(local_shape(param), p, size), dtype=torch.float32)
                (output_init_method if name.endswith(OUTPUT_WEIGHTS) else init_method)(full)
                set_value(param, partition(full, p, rank, size))
            elif name.endswith(PARALLEL_BIASES):
                set_value(param, torch.zeros(local_shape(param)))
            if p.dim is not None and not hasattr(param, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(param, True, p.dim, 1)


def local_shape(param: torch.nn.Parameter) -> torch.Size:
    """The shape of this tensor-parallel rank's part (whole over the ZeRO-3 partitions)."""
    return param.ds_shape if is_partitioned(param) else param.shape


def set_value(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write this tensor-parallel rank's part ``value`` into ``param`` (its partition of it under ZeRO-3)."""
    if is_partitioned(param):
        write_whole_value(param, value)
    else:
        param.copy_(value)


def full_shape(shape: torch.Size, p: Partitioning, size: int) -> tuple[int, ...]:
    """The shape at tensor-parallel size 1 of a parameter whose part at ``size`` has ``shape``."""
    full = list(shape)
    if p.dim is not None:
        full[p.dim] = p.full_width(full[p.dim], size)
    return tuple(full)
