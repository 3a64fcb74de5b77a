"""One rank of the 2-rank save -> plan -> load test; started by tests/distributed/test_ckpt_orchestration_distributed.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/orchestration_worker.py ROOT

Per-rank RNG states and per-rank optimizer shards must survive a full resume: the resumed step equals the
unbroken one bit for bit on every rank. A failed check raises, so a non-zero exit fails the test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megatron.checkpointing import inventory_checkpoint, load_checkpoint, plan_load, save_checkpoint  # noqa: E402
from megatron.runtime.initialize import init_deepspeed_distributed, leave_process_group  # noqa: E402
from tests.ckpt_engines import build_engine, make_args, tiny_batch, train_step  # noqa: E402
from tests.worker_report import report  # noqa: E402

WORLD_SIZE = 2


def _full_weights(engine) -> dict[str, torch.Tensor]:
    from deepspeed import zero

    with zero.GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def main(root: str) -> None:
    init_deepspeed_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    args = make_args(stage=2, precision="bf16", save=root, load=root)

    def step(engine, iteration):  # each rank its own batch
        train_step(engine, tiny_batch(args, 100 * rank + iteration))

    original = build_engine(args, seed=0)
    torch.manual_seed(10 + rank)  # dropout differs per rank, as in training
    for iteration in (1, 2):
        step(original, iteration)
    save_checkpoint(args, original, 2, consumed_train_samples=8)
    step(original, 3)
    expected = _full_weights(original)

    plan = plan_load(args, data_parallel_size=WORLD_SIZE)
    assert plan.load_optimizer and plan.restore_rng
    resumed = build_engine(args, seed=1)
    torch.manual_seed(999)  # the same on both ranks: only a per-rank restore gives back the masks
    outcome = load_checkpoint(resumed, plan)
    assert (outcome.iteration, outcome.consumed_train_samples) == (2, 8)
    step(resumed, 3)
    for name, value in _full_weights(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=f"rank {rank}: {name}")
    report(case="resumed step", bit_identical=True)

    if rank == 0:
        tag = inventory_checkpoint(root).tags["global_step2"]
        report(case="saved tag", optimizer_dp_ranks=list(tag.optimizer_dp_ranks),
               data_parallel=tag.saved_layout.data_parallel, rng_states=len(tag.metadata.client_state.rng_states),
               one_rank_plan=plan_load(args, 1).describe(),
               finetune_module_only=plan_load(make_args(stage=2, precision="bf16", load=root, finetune=True),
                                              data_parallel_size=1).module_only)
    torch.distributed.barrier()
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
