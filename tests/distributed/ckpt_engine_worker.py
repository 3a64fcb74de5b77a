"""One rank of the 2-rank engine-checkpoint test; started by tests/distributed/test_ckpt_engine_distributed.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/ckpt_engine_worker.py <work dir>

Every check raises on failure, so a non-zero exit of any rank fails the test. Rank 0 saves the
values each checkpoint must hold to <work dir>/<name>-expected.pt for the one-rank side of the test.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import logger as deepspeed_logger  # noqa: E402
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402

from megatron.checkpointing.errors import CheckpointError  # noqa: E402
from megatron.checkpointing.loading import master_weights as master_weights_module  # noqa: E402
from megatron.checkpointing.loading.module_load import load_module_only  # noqa: E402
from megatron.checkpointing.ondisk.module_weights import read_module_weights  # noqa: E402
from megatron.checkpointing.saving.engine_save import save_engine_checkpoint  # noqa: E402
from megatron.runtime.initialize import init_deepspeed_distributed, leave_process_group  # noqa: E402
from tests.ckpt_engines import (  # noqa: E402
    batch,
    bits_equal,
    build_engine,
    ds_config,
    eval_loss,
    master_weights,
    refresh_that_only_checks,
    set_lr,
    train_step,
    training_weights,
)
from tests.worker_report import report  # noqa: E402

CASES = {
    "bf16-zero2": ds_config("bf16", 2),
    "bf16-zero3": ds_config("bf16", 3),
    "bf16-zero3-partitioned": ds_config("bf16", 3, zero={"stage3_param_persistence_threshold": 0}),
}


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"rank {dist.get_rank()}: {message}")


def expected_values(engine) -> dict[str, torch.Tensor]:
    if engine.zero_optimization_stage() == 3:
        return master_weights(engine)
    return {name: value.float() for name, value in training_weights(engine).items()}


def assert_holds(engine, expected: dict[str, torch.Tensor], what: str) -> None:
    weights, masters = training_weights(engine), master_weights(engine)
    for name, value in expected.items():
        check(bits_equal(weights[name], value.bfloat16()), f"{what}: training weights of {name} differ")
        check(bits_equal(masters[name], value), f"{what}: fp32 master of {name} differs")


def module_only_round_trip(work_dir: Path, name: str) -> None:
    rank = dist.get_rank()
    config = CASES[name]
    engine_a = build_engine(config, seed=1)
    train_step(engine_a, batch(10 + rank))
    assert save_engine_checkpoint(engine_a, work_dir / name, "global_step1", {"iteration": 1}) is None
    tag_dir = work_dir / name / "global_step1"
    expected = expected_values(engine_a)
    fixed = batch(20 + rank)
    loss_a = eval_loss(engine_a, fixed)
    if rank == 0:
        torch.save(expected, work_dir / f"{name}-expected.pt")
        if engine_a.zero_optimization_stage() == 3:
            shards_only = work_dir / f"{name}-shards" / "global_step1"
            shutil.copytree(tag_dir, shards_only)
            (shards_only / "mp_rank_00_model_states.pt").unlink()
            rebuilt = read_module_weights(shards_only)
            reference = get_fp32_state_dict_from_zero_checkpoint(str(shards_only.parent), tag="global_step1")
            for param_name, value in expected.items():
                check(
                    bits_equal(rebuilt[param_name], value), f"shards of 2 ranks rebuilt {param_name} wrongly"
                )
                check(bits_equal(reference[param_name], value), f"zero_to_fp32 disagrees on {param_name}")
    dist.barrier()
    if rank == 0:
        for optimizer_file in tag_dir.glob("*optim_states.pt"):
            optimizer_file.unlink()
    dist.barrier()

    engine_b = build_engine(config, seed=2)
    # A step first: ZeRO-3 then holds its small ("persistent") parameters whole next to the partitions.
    train_step(engine_b, batch(30 + rank))
    load_module_only(engine_b, read_module_weights(tag_dir))
    check(torch.equal(eval_loss(engine_b, fixed), loss_a), f"{name}: first forward after the load differs")
    set_lr(engine_b, 0.0)
    train_step(engine_b, batch(10 + rank))
    assert_holds(engine_b, expected, name)
    check(
        torch.equal(eval_loss(engine_b, fixed), loss_a),
        f"{name}: loss on a fixed batch differs from engine A's",
    )

    # The guard on 2 ranks: a master left stale fails the load on every rank.
    engine_c = build_engine(config, seed=3)
    refresh = master_weights_module.refresh_master_weights
    master_weights_module.refresh_master_weights = refresh_that_only_checks
    try:
        load_module_only(engine_c, read_module_weights(tag_dir))
        raise AssertionError(f"rank {rank}: {name}: a stale master passed verification")
    except CheckpointError as err:
        check("master weights differ" in str(err), f"{name}: unexpected error {err}")
    finally:
        master_weights_module.refresh_master_weights = refresh

    # Ranks agree: a master element spoiled on rank 1 only fails verification on rank 0 too.
    if rank == 1:
        fragment = next(iter(master_weights_module.master_fragments(engine_b)))
        with torch.no_grad():
            fragment.master[0] += 1.0
    try:
        master_weights_module.verify_master_weights(engine_b)
        raise AssertionError(f"rank {rank}: {name}: a mismatch on rank 1 went unnoticed")
    except CheckpointError as err:
        check("rank(s) [1]" in str(err), f"{name}: error does not name rank 1: {err}")


def main() -> None:
    work_dir = Path(sys.argv[1])
    deepspeed_logger.setLevel(logging.ERROR)
    init_deepspeed_distributed(dist_backend="gloo")
    check(dist.get_world_size() == 2, "expects 2 ranks")
    dist.barrier()  # every rank has removed its own buffer's name
    left = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{os.environ['MASTER_PORT']}_*"))
    check(not left, f"DeepSpeed's shared-memory buffer names outlive the start-up: {left}")
    for name in CASES:
        module_only_round_trip(work_dir, name)
        if dist.get_rank() == 0:
            report(case=name, ok=True)
    dist.barrier()


if __name__ == "__main__":
    main()
    leave_process_group()
