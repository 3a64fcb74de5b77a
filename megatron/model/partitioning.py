"""How each parameter is split across tensor-parallel ranks, and moving weights between split sizes.

A parameter is either replicated (every rank holds all of it) or split along one dimension. Along
that dimension it may consist of blocks that are split separately, each rank taking its share of
every block (GPT-NeoX's per-partition layouts):

- ``query_key_value`` with grouped-query attention: [queries, keys, values], so rank r holds
  [its queries, its keys, its values]. Its blocks count attention heads, which are never split: with
  fewer key/value heads than ranks, rank r holds the one key head and one value head its query heads
  use (head ``r * num_kv_heads // size``), replicated over the ``size // num_kv_heads`` neighbouring
  ranks that share it. GPT-NeoX refuses this case; a save writes each rank's parameter as that rank
  holds it, so every rank file has the same shape and a replicated head is stored once per rank;
  joining or re-splitting reads each head from the first part that holds it;
- the query and key norms across heads (``qk_layernorm_across_heads``, OLMoE): as wide as the query and key
  projections, split into whole heads as their rows in ``query_key_value`` are;
- ``mlp.linear1`` for swiglu: [up, gate], so rank r holds [its up rows, its gate rows];
- the experts' stacked weights ``mlp.experts.mlp.w1`` / ``w3`` / ``w2`` (megatron/model/moe.py): one block of
  ``moe_num_experts`` experts, never split, so rank r holds the rows of experts
  r x per_rank .. (r + 1) x per_rank - 1 (``experts_per_rank``), as GPT-NeoX's rank files hold them. A
  part with the rows of fewer experts than its share is a checkpoint that lost experts
  (``missing_experts``).

LoRA's adapters (megatron/model/lora.py) split to match the layer they adapt: on a column-parallel
layer A is whole and B split as the rows of the layer's output it adds into (a fused layer's part as
that part's rows are split); on a row-parallel layer A is split by input columns and B is whole. An
expert parameter's adapters (A [experts x r, in], B [experts x out, r]) split as the experts' weights, by experts.

With one key/value head per query head, ``query_key_value`` is per head [q, k, v] and a plain
split gives each rank whole heads. The full tensor is the one a tensor-parallel size of 1 holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from megatron.contract.architecture import Architecture, experts_per_rank
from megatron.contract.lora_settings import target_of


@dataclass(frozen=True)
class Partitioning:
    dim: int | None  # None: replicated
    blocks: tuple[int, ...] = (1,)  # relative widths of the blocks along `dim`, each split on its own
    heads: bool = False  # blocks count attention heads: a block with fewer heads than ranks is replicated
    experts: bool = False  # blocks count experts: each rank holds whole experts, an even share of each block

    def unit_width(self, full_width: int) -> int:
        unit, rest = divmod(full_width, sum(self.blocks))
        if rest:
            raise ValueError(f"width {full_width} does not split into blocks {self.blocks}")
        return unit

    def replicated_block(self, block: int, size: int) -> bool:
        """Whether every rank of ``size`` holds one whole unit of a block ``block`` units wide."""
        if not self.heads or block >= size:
            return False
        if size % block:
            raise ValueError(f"{block} heads cannot be shared evenly by {size} tensor-parallel ranks")
        return True

    def units_per_rank(self, block: int, size: int) -> Fraction:
        """How many units of a block ``block`` units wide each rank of ``size`` holds."""
        if self.replicated_block(block, size):
            return Fraction(1)
        return Fraction(experts_per_rank(block, size) if self.experts else Fraction(block, size))

    def full_width(self, part_width: int, size: int) -> int:
        """Width along ``dim`` of the full tensor whose parts at size ``size`` are ``part_width`` wide."""
        units_per_rank = sum(self.units_per_rank(block, size) for block in self.blocks)
        unit = Fraction(part_width) / units_per_rank
        if unit.denominator != 1:
            raise ValueError(f"a part {part_width} wide is not one of {size} parts of blocks {self.blocks}")
        return int(unit) * sum(self.blocks)


REPLICATED = Partitioning(None)

EXPERT_WEIGHTS = ("mlp.experts.mlp.w1", "mlp.experts.mlp.w3", "mlp.experts.mlp.w2")

# Weights drawn from the output-layer init method (the others from the plain one).
OUTPUT_WEIGHTS = ("attention.dense.weight", "mlp.linear2.weight", "mlp.experts.mlp.w2")
# Weights drawn at initialisation; every other parameter starts as its module made it.
INITIALISED_WEIGHTS = (
    "word_embeddings.weight",
    "position_embeddings.weight",
    "attention.query_key_value.weight",
    "mlp.linear1.weight",
    "final_linear.weight",
    "rm_linear.weight",
    "mlp.router.layer.weight",
    "mlp.experts.mlp.w1",
    "mlp.experts.mlp.w3",
    *OUTPUT_WEIGHTS,
)
# Biases of split layers, set to zero at initialisation.
PARALLEL_BIASES = ("attention.query_key_value.bias", "mlp.linear1.bias", "attention.dense.bias", "mlp.linear2.bias")


def partitioning(name: str, arch: Architecture) -> Partitioning:
    """How parameter ``name`` (as in ``GPTModel.state_dict()``) is split across tensor-parallel ranks."""
    if ".lora." in name:
        return _adapter_partitioning(name, arch)
    if name.endswith(("word_embeddings.weight", "final_linear.weight")):
        return Partitioning(0)
    if name.endswith(("attention.query_key_value.weight", "attention.query_key_value.bias")):
        if arch.num_kv_heads < arch.num_attention_heads:
            return Partitioning(0, (arch.num_attention_heads, arch.num_kv_heads, arch.num_kv_heads), heads=True)
        return Partitioning(0)
    if arch.qk_layernorm_across_heads and ".attention.q_layernorm." in name:  # scales the query rows
        return Partitioning(0, (arch.num_attention_heads,), heads=True)
    if arch.qk_layernorm_across_heads and ".attention.k_layernorm." in name:
        return Partitioning(0, (arch.num_kv_heads,), heads=True)
    if name.endswith(("mlp.linear1.weight", "mlp.linear1.bias")):
        return Partitioning(0, (1, 1) if arch.activation == "swiglu" else (1,))
    if name.endswith(("attention.dense.weight", "mlp.linear2.weight", "rm_linear.weight")):
        return Partitioning(1)
    if name.endswith(EXPERT_WEIGHTS):
        return Partitioning(0, (arch.moe_num_experts,), experts=True)
    return REPLICATED


def local_experts(arch: Architecture, rank: int, size: int) -> range:
    """The experts rank ``rank`` of ``size`` holds: those whose rows its part of an expert weight holds."""
    (start, length), = _ranges(partitioning(EXPERT_WEIGHTS[0], arch), arch.moe_num_experts, rank, size)
    return range(start, start + length)


def missing_experts(name: str, part: torch.Tensor, arch: Architecture, rank: int, size: int) -> str | None:
    """What rank ``rank`` of ``size``'s part of parameter ``name`` lacks of its experts (a phrase), None when the part
    holds the rows of all of them (or ``name`` holds no experts)."""
    if not partitioning(name, arch).experts or ".lora." in name:  # an adapter's rows per expert are r or its
        return None  # output width, which the settings give: its shape is checked where it loads
    held, width = local_experts(arch, rank, size), arch.moe_intermediate_size
    rows = part.shape[0]
    if rows == len(held) * width:
        return None
    lost = (experts_named(range(held.start + rows // width, held.stop)) if rows < len(held) * width
            else "rows of other experts")
    return (f"{name} holds {rows} rows, the rows of {experts_named(held)} ({width} each) expected at "
            f"tensor-parallel size {size}: {lost} missing")


def experts_named(experts: range) -> str:
    return f"expert {experts.start}" if len(experts) == 1 else f"experts {experts.start}..{experts.stop - 1}"


def _adapter_partitioning(name: str, arch: Architecture) -> Partitioning:
    """A LoRA adapter's A or B (module docstring); ``name`` is ``<linear>.lora.<HF module>.lora_<A or B>``."""
    linear, _, adapter = name.rpartition(".lora.")
    module, side = adapter.split(".")
    if linear.endswith("mlp.experts.mlp"):  # an expert parameter's: each expert's rows together, as its weights
        return Partitioning(0, (arch.moe_num_experts,), experts=True)
    layer = partitioning(f"{linear}.weight", arch)
    column_parallel = layer.dim == 0
    if side == "lora_A":
        return REPLICATED if column_parallel else layer
    if not column_parallel:
        return REPLICATED
    part = target_of(module).part
    if part is None:
        return layer
    if part in ("key", "value"):  # whole heads; fewer than ranks: replicated as query_key_value's are
        return Partitioning(0, (arch.num_kv_heads,), heads=True)
    return Partitioning(0)


def _ranges(p: Partitioning, full_width: int, rank: int, size: int) -> list[tuple[int, int]]:
    """(start, length) along ``p.dim`` of the full tensor of each piece rank ``rank`` of ``size`` holds."""
    unit = p.unit_width(full_width)
    ranges, start = [], 0
    for block in p.blocks:
        if p.replicated_block(block, size):
            ranges.append((start + rank * block // size * unit, unit))
        else:
            share = int(p.units_per_rank(block, size) * unit)
            ranges.append((start + rank * share, share))
        start += block * unit
    return ranges


def partition(full: torch.Tensor, p: Partitioning, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` at tensor-parallel size ``size`` (a view where it is one piece)."""
    if p.dim is None or size == 1:
        return full
    pieces = [full.narrow(p.dim, start, length) for start, length in _ranges(p, full.shape[p.dim], rank, size)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=p.dim)


def repartition(parts: Sequence[torch.Tensor], p: Partitioning, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part at size ``size`` from all parts of one parameter saved at size ``len(parts)``.

    Reads only the slices of ``parts`` the result holds (with memory-mapped parts, only those pages).
    """
    saved = len(parts)
    if p.dim is None:
        return parts[0]
    if saved == size:
        return parts[rank]
    full_width = p.full_width(parts[0].shape[p.dim], saved)
    # (saved part, start in the full tensor, length, offset in the part) of every saved piece
    saved_pieces = []
    for source_rank, source in enumerate(parts):
        offset = 0
        for start, length in _ranges(p, full_width, source_rank, saved):
            saved_pieces.append((source, start, length, offset))
            offset += length
    pieces = []
    for start, length in _ranges(p, full_width, rank, size):
        position, end = start, start + length
        while position < end:  # the first saved piece holding `position` (a replicated head is in several)
            source, s_start, s_length, offset = next(
                piece for piece in saved_pieces if piece[1] <= position < piece[1] + piece[2])
            high = min(end, s_start + s_length)
            pieces.append(source.narrow(p.dim, offset + position - s_start, high - position))
            position = high
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=p.dim)


def repartition_state_dict(
    parts: Sequence[Mapping[str, torch.Tensor]], arch: Architecture, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """This rank's state dict at size ``size`` from the state dicts of every rank of a size-``len(parts)`` save.

    Keys follow ``parts[0]``; a key some part lacks is left out (strict loading then names it).
    """
    result = {}
    for name in parts[0]:
        if all(name in part for part in parts):
            result[name] = repartition([part[name] for part in parts], partitioning(name, arch), rank, size)
    return result
