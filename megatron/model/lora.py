"""LoRA adapters on the model's linear layers, computed as PEFT's (its settings: megatron/contract/lora_settings.py).

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

Under tensor parallelism the adapters are split as the layer they adapt (megatron/model/partitioning.py).
On a column-parallel layer each rank holds A whole and the rows of B its part of the output has, and A's
output enters the tensor-parallel region as the layer's input does: its gradient, and so A's and the
input's, is summed over the ranks. On a row-parallel layer each rank holds A's columns of its part of the
input, the ranks' A outputs are summed (the layer's own output is already summed when the hook sees it),
and B, whole on every rank, gets the whole gradient. A key/value head shared by several ranks (fewer heads
than ranks) has its B gradient summed over them, as ``query_key_value``'s own. The weights are drawn
whole, as at size 1, and each rank keeps its part, so the adapters are the same at every size. With
lora_dropout the masks at size 2 are other draws than at size 1 (every tensor-parallel rank draws from the
same state, as the base's dropout does), so runs are equal across sizes without dropout.

The experts of a mixture-of-experts layer (``experts.gate_up_proj``, ``experts.down_proj``: PEFT's
``target_parameters`` on transformers' fused 3-D expert parameters) get an adapter pair per expert
(``ExpertAdapters``, the child ``lora`` of the layer's ExpertWeights): A [experts x r, in] and B [experts x out, r],
each expert's rows together, so that tensor-parallel ranks, which hold whole experts, split them as the expert
weights. Each expert's scaled B A is added to its slice of the weight before the experts run (as PEFT
parametrizes the parameter), so the grouped and the one-by-one expert paths both compute with the adapted
weights, and no collective is needed: the ranks' experts and adapters are disjoint.

Under sequence parallelism (megatron/model/sequence_parallel.py) a column-parallel layer's input is this rank's
part of the sequence: A runs on it and its low-rank output is gathered (A's gradient then covers the part only
and is summed over the ranks); a row-parallel layer's output is this rank's part: the ranks' A outputs are
reduce-scattered, and B, applied to the part, has its gradient summed over the ranks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

from megatron.contract.architecture import Architecture
from megatron.contract.lora_settings import LoraSettings, adapter_key
from megatron.model.attention import query_key_value_rows
from megatron.model.init_methods import full_shape, local_shape, set_value
from megatron.model.parallel_layers import (
    RowParallelLinear,
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    sum_gradient_over_sequence_parts,
    sum_over_ranks_sharing_a_slot,
)
from megatron.model.partitioning import partition, partitioning
from megatron.model.sequence_parallel import gather_sequence, reduce_scatter_sequence
from megatron.ranks import tensor_parallel_rank, tensor_parallel_size


class LoraAdapter(torch.nn.Module):
    """One PEFT adapter: B A dropout(x), into ``rows`` of the layer's output (all of it when None).

    ``input_is_parallel``: the layer is row-parallel, so x and A are this rank's columns (module docstring).
    ``layer_width``: the layer's output width on this rank, which ``rows`` index.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, dropout: float, rows: torch.Tensor | None,
                 layer_width: int, input_is_parallel: bool):
        super().__init__()
        self.lora_A = torch.nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_features, rank))
        self.dropout = dropout
        self.layer_width = layer_width
        self.input_is_parallel = input_is_parallel
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A dropout(x), B placed at its rows of the layer's output: layer width x r, zero elsewhere).

        Both are new tensors made here, where ZeRO-3 has gathered the parameters."""
        low_rank = F.linear(F.dropout(x, self.dropout, self.training), self.lora_A)
        if self.rows is None:
            return low_rank, self.lora_B.clone()
        return low_rank, self.lora_B.new_zeros(self.layer_width, self.lora_B.shape[1]).index_copy(0, self.rows,
                                                                                                  self.lora_B)

    def parameter_on_sequence_parts(self) -> torch.nn.Parameter:
        """The matrix a split sequence applies to this rank's part only (module docstring)."""
        return self.lora_B if self.input_is_parallel else self.lora_A


class LinearAdapters(torch.nn.ModuleDict):
    """The adapters of one linear layer, by their HF module's name."""

    def __init__(self, adapters: dict[str, LoraAdapter], scaling: float, input_is_parallel: bool):
        super().__init__(adapters)
        self.scaling = scaling
        self.input_is_parallel = input_is_parallel
        self.switched_on = True

    def forward(self, x: torch.Tensor, out: torch.Tensor, split: bool = False) -> torch.Tensor:
        # The adapters of a fused layer in one product: each B is placed at its rows and zero elsewhere, so every
        # row gets its own adapter's B A dropout(x) and the output is added to once (an index_add per adapter
        # copied the whole output each time). The A outputs enter the tensor-parallel region joined: the gradient
        # that comes back is then one contiguous tensor (megatron-core's copy region leaves a non-contiguous
        # gradient, such as a slice of a join's, unreduced).
        low_ranks, placed = zip(*(adapter(x) for adapter in self.values()), strict=True)
        low_rank = torch.cat(low_ranks, dim=-1)
        if self.input_is_parallel:
            low_rank = reduce_scatter_sequence(low_rank) if split else reduce_from_tensor_parallel_region(low_rank)
        else:
            low_rank = gather_sequence(low_rank) if split else copy_to_tensor_parallel_region(low_rank)
        return out + F.linear(low_rank, torch.cat(placed, dim=1)) * self.scaling


class ExpertAdapter(torch.nn.Module):
    """One expert parameter's adapters, a pair per local expert: A [experts x r, in], B [experts x out, r]."""

    def __init__(self, experts: int, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.experts = experts
        self.lora_A = torch.nn.Parameter(torch.empty(experts * rank, in_features))
        self.lora_B = torch.nn.Parameter(torch.zeros(experts * out_features, rank))

    def delta(self) -> torch.Tensor:
        """Each expert's B A, [experts, out, in]."""
        return self.product(self.lora_A, self.lora_B, self.experts)

    @staticmethod
    def product(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> torch.Tensor:
        rank = lora_a.shape[0] // experts
        return torch.bmm(lora_b.view(experts, -1, rank), lora_a.view(experts, rank, -1))


class ExpertAdapters(torch.nn.ModuleDict):
    """The adapters of one layer's expert parameters, by the parameter's name (gate_up_proj, down_proj)."""

    def __init__(self, adapters: dict[str, ExpertAdapter], scaling: float):
        super().__init__(adapters)
        self.scaling = scaling
        self.switched_on = True

    def deltas(self) -> dict[str, torch.Tensor]:
        """What each parameter gets added, per expert: scaling B A, [experts, out, in]."""
        return {name: adapter.delta() * self.scaling for name, adapter in self.items()}


def _add_adapter_output(linear: torch.nn.Module, inputs: tuple, output: tuple) -> tuple:
    if not linear.lora.switched_on:
        return output
    out, bias = output  # megatron-core's linear layers return (output, bias or None)
    return linear.lora(inputs[0], out, *inputs[1:]), bias  # (input[, split]) as the layer was called


@contextmanager
def adapters_switched_off(model: torch.nn.Module):
    """Within the block ``model`` computes as its base, as if it had no adapters."""
    adapters = [module for module in model.modules() if isinstance(module, LinearAdapters | ExpertAdapters)]
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


def _rows_of_parts(arch: Architecture, size: int) -> dict[str, torch.Tensor]:
    """The output rows of each part of a fused layer on a rank of tensor-parallel ``size`` (megatron/model/attention.py
    and mlp.py lay them out)."""
    query, key, value = query_key_value_rows(arch, size)
    up = torch.arange(arch.intermediate_size // size)
    return {"query": query, "key": key, "value": value, "up": up, "gate": up + len(up)}


def add_adapters(model: torch.nn.Module, lora: LoraSettings) -> None:
    """Give each transformer layer of ``model`` (a GPTModel) the adapters ``lora`` targets and freeze the rest."""
    model.requires_grad_(False)
    for layer in model.layers:
        add_layer_adapters(layer, model.arch, lora)
    if model.arch.reward_head:
        model.reward_head.requires_grad_(True)


def add_layer_adapters(layer: torch.nn.Module, arch: Architecture, lora: LoraSettings) -> None:
    """Give one transformer layer the adapters ``lora`` targets (they train; the caller freezes the base)."""
    size = tensor_parallel_size()
    rows_of_part = _rows_of_parts(arch, size)
    by_linear: dict[str, dict[str, str | None]] = defaultdict(dict)
    expert_targets = []
    for name, target in lora.targets().items():
        if target.experts:
            expert_targets.append(name)
        else:
            by_linear[target.linear][name] = target.part
    if expert_targets and hasattr(layer.mlp, "experts"):  # a layer between expert layers has none
        add_expert_adapters(layer.mlp.experts.mlp, expert_targets, lora)
    for linear_name, parts in by_linear.items():
        linear = layer.get_submodule(linear_name)
        out_features, in_features = local_shape(linear.weight)
        adapters = {}
        for name, part in parts.items():
            rows = None if part is None else rows_of_part[part]
            width = out_features if rows is None else len(rows)
            adapter = LoraAdapter(in_features, width, lora.rank, lora.dropout, rows, out_features,
                                  isinstance(linear, RowParallelLinear))
            if part in ("key", "value") and arch.num_kv_heads < size:
                shared_head = tensor_parallel_rank() * arch.num_kv_heads // size
                adapter.lora_B.register_hook(partial(sum_over_ranks_sharing_a_slot, slot=shared_head,
                                                     slots=arch.num_kv_heads))
            if arch.splits_sequence:
                sum_gradient_over_sequence_parts(adapter.parameter_on_sequence_parts())
            adapters[name] = adapter
        linear.lora = LinearAdapters(adapters, lora.scaling, isinstance(linear, RowParallelLinear))
        linear.register_forward_hook(_add_adapter_output)


def add_expert_adapters(mlp: torch.nn.Module, targets: list[str], lora: LoraSettings) -> None:
    """Give a layer's ExpertWeights ``mlp`` the adapters of the expert parameters ``targets`` names."""
    experts, width, hidden = len(mlp.local), mlp.width, mlp.w1.shape[1]
    shapes = {"gate_up_proj": (2 * width, hidden), "down_proj": (hidden, width)}  # (out, in) of each expert's slice
    adapters = {}
    for name in targets:
        out_features, in_features = shapes[adapter_key(name)]
        adapters[adapter_key(name)] = ExpertAdapter(experts, in_features, out_features, lora.rank)
    mlp.lora = ExpertAdapters(adapters, lora.scaling)


def initialise_adapters(model: torch.nn.Module, arch: Architecture) -> None:
    """Draw every adapter's weights in ``model`` (a GPTModel or one of its layers) as PEFT does
    (LoraLayer.reset_lora_parameters with init_lora_weights True: A kaiming-uniform, B zero), in registration
    order from the current RNG state, each whole as at tensor-parallel size 1; this rank keeps its part."""
    rank, size = tensor_parallel_rank(), tensor_parallel_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".lora_A"):
                p = partitioning(name, arch)
                whole = torch.empty(full_shape(local_shape(param), p, size), dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5))
                set_value(param, partition(whole, p, rank, size))
            elif name.endswith(".lora_B"):
                set_value(param, torch.zeros(local_shape(param)))
