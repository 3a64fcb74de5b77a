"""Which rank this is, and agreeing across ranks: in one real process group of one rank, and what two gloo
ranks report to each other (the signal, divergence and save-failure runs on 2 ranks use it end to end)."""

from pathlib import Path

from megatron.ranks import (
    data_parallel_rank_and_size,
    global_rank,
    rank_and_world,
    tensor_parallel_rank,
    tensor_parallel_size,
)
from megatron.runtime.collective import decided_by_rank_zero, first_report, reported_by_ranks
from tests.conftest import run_rank_worker
from tests.distributed.votes_worker import VOTES

WORKER = Path(__file__).with_name("votes_worker.py")


def test_a_single_rank_is_rank_0_of_every_group(single_rank_world):
    assert (global_rank(), rank_and_world(), data_parallel_rank_and_size()) == (0, (0, 1), (0, 1))
    assert (tensor_parallel_rank(), tensor_parallel_size()) == (0, 1)


def test_what_a_lone_rank_reports_is_what_every_rank_agrees_on(single_rank_world):
    assert first_report(None) is None and first_report(0) == 0 and decided_by_rank_zero("disk full") == "disk full"
    assert reported_by_ranks(None) == []
    assert reported_by_ranks("disk full") == [(0, "disk full")]
    assert reported_by_ranks(0) == [(0, 0)]  # a value that is false still counts; only None is silence


def test_every_rank_hears_what_any_rank_reports_and_silence_is_silence():
    records = run_rank_worker(WORKER)
    expected = {
        "reported": [[[rank, value] for rank, value in enumerate(values) if value is not None] for values in VOTES],
        "first": [None, "disk full", "bad master", 0, None],  # the lowest reporting rank's, a false value too
        "rank_zero": [None, None, "bad master", 0, None],  # rank 0's, even where only rank 1 has something to say
    }
    assert sorted(record["rank"] for record in records) == [0, 1]
    for record in records:
        assert {key: record[key] for key in expected} == expected
