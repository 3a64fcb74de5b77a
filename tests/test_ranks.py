"""Which rank this is, and agreeing across ranks, in one real process group of one rank (the answers of
several ranks are exercised by the signal, divergence and save-failure runs on 2 ranks)."""

from megatron.collective import reported_by_ranks
from megatron.ranks import (
    data_parallel_rank_and_size,
    global_rank,
    rank_and_world,
    tensor_parallel_rank,
    tensor_parallel_size,
)


def test_a_single_rank_is_rank_0_of_every_group(single_rank_world):
    assert (global_rank(), rank_and_world(), data_parallel_rank_and_size()) == (0, (0, 1), (0, 1))
    assert (tensor_parallel_rank(), tensor_parallel_size()) == (0, 1)


def test_what_a_lone_rank_reports_is_what_every_rank_agrees_on(single_rank_world):
    assert reported_by_ranks(None) == []
    assert reported_by_ranks("disk full") == [(0, "disk full")]
    assert reported_by_ranks(0) == [(0, 0)]  # a value that is false still counts; only None is silence
