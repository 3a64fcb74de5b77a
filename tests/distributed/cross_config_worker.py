"""The 2-rank phases of the cross-config fine-tune tests; started by tests/distributed/test_ckpt_cross_config.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/cross_config_worker.py PHASE ROOT

`save fp32 zero0` trains and saves on both ranks and writes the saved weights to ROOT/expected.pt;
`finetune fp16 zero1` fine-tunes from ROOT and checks the weights and masters against that file. A failed
check raises, so a non-zero exit fails the test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megatron.runtime.initialize import init_deepspeed_distributed, leave_process_group  # noqa: E402
from tests.ckpt_engines import (  # noqa: E402
    DTYPES,
    bits_equal,
    build_engine,
    make_args,
    master_weights,
    set_lr,
    tiny_batch,
    train_step,
    training_weights,
)
from tests.conftest import declare_cpu_fp16_capable  # noqa: E402
from tests.worker_report import report  # noqa: E402

EXPECTED = "expected.pt"


def save_trained(args, steps: int = 2, rank: int = 0) -> dict[str, torch.Tensor]:
    """Train `steps` steps (each rank its own batches), save, and return the saved weights in fp32."""
    from megatron.checkpointing import save_checkpoint

    engine = build_engine(args, seed=0)
    for step in range(1, steps + 1):
        train_step(engine, tiny_batch(args, 100 * rank + step))
    save_checkpoint(args, engine, steps, consumed_train_samples=2 * steps)
    return {name: value.float() for name, value in training_weights(engine).items()}


def finetune_and_check(args, data_parallel_size: int, expected: dict[str, torch.Tensor], rank: int = 0) -> None:
    from megatron.checkpointing import load_checkpoint, plan_load

    plan = plan_load(args, data_parallel_size)
    assert plan.module_only and all("optim_states" not in path.name for path in plan.files)
    engine = build_engine(args, seed=1)  # other initial weights: only the load can make them equal
    load_checkpoint(engine, plan)
    set_lr(engine, 0.0)
    train_step(engine, tiny_batch(args, 500 + rank))
    dtype = DTYPES[args.precision]
    weights, masters = training_weights(engine), master_weights(engine)
    assert set(weights) == set(expected)
    for name, value in expected.items():
        assert bits_equal(weights[name], value.to(dtype)), f"rank {rank}: training weights of {name}"
        assert bits_equal(masters[name], value), f"rank {rank}: fp32 master of {name}"


def main(phase: str, root: str) -> None:
    init_deepspeed_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    if phase == "save fp32 zero0":
        expected = save_trained(make_args(stage=0, precision="fp32", save=root), rank=rank)
        if rank == 0:
            torch.save(expected, Path(root) / EXPECTED)
    elif phase == "finetune fp16 zero1":
        declare_cpu_fp16_capable()
        args = make_args(stage=1, precision="fp16", load=root, finetune=True)
        finetune_and_check(args, 2, torch.load(Path(root) / EXPECTED), rank=rank)
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    torch.distributed.barrier()
    report(phase=phase, ok=True)
    leave_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
