"""The fused QKV weight's split with fewer key/value heads than tensor-parallel ranks: each rank holds
its query heads and the key and value head they use; parts move between sizes without losing a row. The
experts' stacked weights: each rank holds a run of whole experts, as GPT-NeoX's rank files do. OLMoE's query and key
norms across heads split as the rows they scale."""

from __future__ import annotations

import pytest
import torch

from megatron.contract.architecture import ModelConfigError
from megatron.model.attention import query_key_value_rows
from megatron.model.partitioning import local_experts, missing_experts, partition, partitioning, repartition
from megatron.neox_arguments import NeoXArgs

QKV = "sequential.2.attention.query_key_value.weight"


def qkv_partitioning(kv_heads: int):
    arch = NeoXArgs.from_dict(dict(num_layers=1, hidden_size=8, num_attention_heads=4, num_kv_heads=kv_heads,
                                   seq_length=4, padded_vocab_size=16, norm="rmsnorm")).architecture()
    return partitioning(QKV, arch)


def labelled(rows: int) -> torch.Tensor:
    """Row i holds i in both columns (head_dim 2 -> rows 2h, 2h+1 are head h's)."""
    return torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 2).clone()


def heads(part: torch.Tensor) -> list[int]:
    """The full-tensor head index (row // 2) of each 2-row head in ``part``."""
    return [int(part[i, 0]) // 2 for i in range(0, part.shape[0], 2)]


# Full heads: queries 0-3, then keys (4.. ), then values; 2 rows per head.
@pytest.mark.parametrize(("kv_heads", "size", "expected"), [
    (1, 2, [[0, 1, 4, 5], [2, 3, 4, 5]]),
    (1, 4, [[0, 4, 5], [1, 4, 5], [2, 4, 5], [3, 4, 5]]),
    (2, 4, [[0, 4, 6], [1, 4, 6], [2, 5, 7], [3, 5, 7]]),
    (2, 2, [[0, 1, 4, 6], [2, 3, 5, 7]]),
])
def test_each_rank_holds_its_query_heads_and_the_key_value_head_they_use(kv_heads, size, expected):
    p = qkv_partitioning(kv_heads)
    full = labelled((4 + 2 * kv_heads) * 2)
    assert [heads(partition(full, p, rank, size)) for rank in range(size)] == expected


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize(("saved", "size"), [(2, 1), (4, 1), (1, 4), (2, 4), (4, 2)])
def test_parts_move_between_sizes_exactly(kv_heads, saved, size):
    p = qkv_partitioning(kv_heads)
    full = labelled((4 + 2 * kv_heads) * 2)
    parts = [partition(full, p, rank, saved).clone() for rank in range(saved)]
    for rank in range(size):
        assert torch.equal(repartition(parts, p, rank, size), partition(full, p, rank, size))
    assert torch.equal(repartition(parts, p, 0, 1), full)


@pytest.mark.parametrize(("kv_heads", "size"), [(2, 2), (4, 2), (4, 4)])
def test_the_query_and_key_norms_across_heads_split_as_the_rows_they_scale(kv_heads, size):
    """OLMoE: on every rank the norm's weights are those of the query (key) positions its query_key_value part holds."""
    arch = NeoXArgs.from_dict(dict(num_layers=1, hidden_size=8, num_attention_heads=4, num_kv_heads=kv_heads,
                                   seq_length=4, padded_vocab_size=16, norm="rmsnorm",
                                   qk_layernorm_across_heads=True)).architecture()
    fused = torch.arange((4 + 2 * kv_heads) * 2)
    for rank in range(size):
        held = partition(fused, partitioning(QKV, arch), rank, size)
        for x, rows, rows_held in zip("qk", query_key_value_rows(arch), query_key_value_rows(arch, size), strict=False):
            position = {int(row): i for i, row in enumerate(rows)}
            norm = partitioning(f"sequential.2.attention.{x}_layernorm.scale", arch)
            assert partition(torch.arange(len(rows)), norm, rank, size).tolist() == [
                position[int(row)] for row in held[rows_held]], (x, rank)


def test_three_ranks_cannot_share_two_key_value_heads():
    with pytest.raises(ValueError, match="2 heads cannot be shared evenly by 3 tensor-parallel ranks"):
        partition(labelled(16), qkv_partitioning(2), 0, 3)


EXPERT_W1 = "sequential.2.mlp.experts.mlp.w1"


def expert_arch(experts: int = 8):
    return NeoXArgs.from_dict(dict(num_layers=1, hidden_size=8, num_attention_heads=4, seq_length=4,
                                   padded_vocab_size=16, norm="rmsnorm", activation="swiglu", intermediate_size=24, use_bias_in_mlp=False,
                                   moe_num_experts=experts, moe_router_type="topk",
                                   moe_intermediate_size=2)).architecture()


def experts_of(part: torch.Tensor) -> list[int]:
    """The expert (row // 2: 2 rows each) of each 2-row block of ``part``."""
    return [int(part[i, 0]) // 2 for i in range(0, part.shape[0], 2)]


@pytest.mark.parametrize("name", [EXPERT_W1, "sequential.2.mlp.experts.mlp.w3", "sequential.2.mlp.experts.mlp.w2"])
@pytest.mark.parametrize(("size", "expected"), [
    (2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (8, [[e] for e in range(8)]),
])
def test_rank_r_holds_experts_r_times_its_share_onwards_as_gpt_neox_does(name, size, expected):
    """GPT-NeoX's ParallelDroplessMLP: rank r holds experts r x E/mp .. (r + 1) x E/mp - 1, each expert's rows
    together; the model runs exactly the experts whose rows its part holds."""
    arch, full = expert_arch(), labelled(16)
    assert [experts_of(partition(full, partitioning(name, arch), rank, size)) for rank in range(size)] == expected
    assert [list(local_experts(arch, rank, size)) for rank in range(size)] == expected


@pytest.mark.parametrize(("saved", "size"), [(2, 1), (1, 2), (2, 4), (4, 2), (8, 2)])
def test_experts_move_between_sizes_exactly(saved, size):
    p, full = partitioning(EXPERT_W1, expert_arch()), labelled(16)
    parts = [partition(full, p, rank, saved).clone() for rank in range(saved)]
    for rank in range(size):
        assert torch.equal(repartition(parts, p, rank, size), partition(full, p, rank, size))


def test_experts_that_do_not_divide_over_the_ranks_are_refused_not_cut():
    with pytest.raises(ModelConfigError, match=r"^8 experts \(moe_num_experts\) cannot be split evenly over 3 tensor-parallel ranks"):
        partition(labelled(16), partitioning(EXPERT_W1, expert_arch()), 0, 3)


def test_a_part_without_all_of_its_experts_says_which_are_missing():
    arch = expert_arch()
    part = partition(labelled(16), partitioning(EXPERT_W1, arch), 1, 2)
    assert missing_experts(EXPERT_W1, part, arch, 1, 2) is None
    assert missing_experts(EXPERT_W1, part[:4], arch, 1, 2) == (
        f"{EXPERT_W1} holds 4 rows, the rows of experts 4..7 (2 each) expected at tensor-parallel size 2: "
        "experts 6..7 missing")
    assert missing_experts(EXPERT_W1, part[:6], arch, 1, 2).endswith(": expert 7 missing")
    assert missing_experts("sequential.2.mlp.router.layer.weight", part[:4], arch, 1, 2) is None
