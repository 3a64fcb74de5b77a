"""Which rank this is, and agreeing across ranks: in one real process group of one rank, and what two gloo
ranks report to each other (the signal, divergence and save-failure runs on 2 ranks use it end to end)."""

import json
import os

import torch.multiprocessing as mp

from megatron.collective import decided_by_rank_zero, first_report, reported_by_ranks
from megatron.ranks import (
    data_parallel_rank_and_size,
    global_rank,
    rank_and_world,
    tensor_parallel_rank,
    tensor_parallel_size,
)
from tests.conftest import free_port

# what rank 0 and rank 1 report, one vote after another
_VOTES = [(None, None), (None, "disk full"), ("bad master", None), (0, "disk full"), (None, None)]


def test_a_single_rank_is_rank_0_of_every_group(single_rank_world):
    assert (global_rank(), rank_and_world(), data_parallel_rank_and_size()) == (0, (0, 1), (0, 1))
    assert (tensor_parallel_rank(), tensor_parallel_size()) == (0, 1)


def test_what_a_lone_rank_reports_is_what_every_rank_agrees_on(single_rank_world):
    assert first_report(None) is None and first_report(0) == 0 and decided_by_rank_zero("disk full") == "disk full"
    assert reported_by_ranks(None) == []
    assert reported_by_ranks("disk full") == [(0, "disk full")]
    assert reported_by_ranks(0) == [(0, 0)]  # a value that is false still counts; only None is silence


def _two_rank_votes(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    from megatron.initialize import init_deepspeed_distributed, leave_process_group

    init_deepspeed_distributed(dist_backend="gloo")
    answers = {"reported": [reported_by_ranks(values[rank]) for values in _VOTES],
               "first": [first_report(values[rank]) for values in _VOTES],
               "rank_zero": [decided_by_rank_zero(values[rank]) for values in _VOTES]}
    with open(f"{out}/rank{rank}.json", "w") as handle:
        json.dump(answers, handle)
    leave_process_group()


def test_every_rank_hears_what_any_rank_reports_and_silence_is_silence(tmp_path):
    mp.spawn(_two_rank_votes, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    expected = {
        "reported": [[[rank, value] for rank, value in enumerate(values) if value is not None] for values in _VOTES],
        "first": [None, "disk full", "bad master", 0, None],  # the lowest reporting rank's, a false value too
        "rank_zero": [None, None, "bad master", 0, None],  # rank 0's, even where only rank 1 has something to say
    }
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected
