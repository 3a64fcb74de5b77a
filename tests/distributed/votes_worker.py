"""One rank of the 2-rank agreement test; started by tests/distributed/test_ranks.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/votes_worker.py

Each vote of VOTES is cast on both ranks through megatron/runtime/collective.py; each rank reports what it heard.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.runtime.collective import decided_by_rank_zero, first_report, reported_by_ranks  # noqa: E402
from megatron.runtime.initialize import init_deepspeed_distributed, leave_process_group  # noqa: E402
from tests.worker_report import report  # noqa: E402

# what rank 0 and rank 1 report, one vote after another
VOTES = [(None, None), (None, "disk full"), ("bad master", None), (0, "disk full"), (None, None)]

if __name__ == "__main__":
    init_deepspeed_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    report(reported=[reported_by_ranks(values[rank]) for values in VOTES],
           first=[first_report(values[rank]) for values in VOTES],
           rank_zero=[decided_by_rank_zero(values[rank]) for values in VOTES])
    leave_process_group()
