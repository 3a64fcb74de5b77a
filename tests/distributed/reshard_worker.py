"""One rank of the 2-rank resharded-resume test; started by tests/distributed/test_ckpt_reshard.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/reshard_worker.py <work dir>

For each model family and precision, a run at DP 2 x TP 1, ZeRO-1 trains and saves; a run at
DP 1 x TP 2, ZeRO-3 resumes it fully through the load plan, trains a step and saves; a run at
DP 2 x TP 1, ZeRO-1 resumes that. After every resume each parameter's fp32 master, exp_avg and
exp_avg_sq, gathered whole with DeepSpeed's safe_get_full_* and over the tensor-parallel group, are
bit-identical to what the saving run held, and the optimizer step count is the saved one. Last, a
resume that leaves one moment of one parameter unrestored must be caught by the same comparison.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import logger as deepspeed_logger  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

from megatron.checkpointing import load_checkpoint, plan_load, save_checkpoint  # noqa: E402
from megatron.checkpointing.loading import reshard
from megatron.model import causal_lm_loss  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.runtime.initialize import init_deepspeed_distributed, leave_process_group  # noqa: E402
from tests.distributed.tensor_parallel_worker import BASE, FAMILIES, batch, check, full, trained_engine  # noqa: E402
from tests.worker_report import report  # noqa: E402

RUN = dict(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1, train_iters=10,
           optimizer={"type": "Adam", "params": {"lr": 1e-2}})
STATES = ("fp32", *reshard.MOMENTS)


def settings(family: str, precision: str, tp: int, stage: int, **paths) -> NeoXArgs:
    values = {**BASE, **FAMILIES[family], **RUN, "precision": precision, "model_parallel_size": tp,
              "zero_optimization": {"stage": stage}, "num_gpus": dist.get_world_size(), **paths}
    if precision == "bf16":
        values["bf16"] = {"enabled": True}
    return NeoXArgs.from_dict(values)


def train(engine, steps: int) -> None:
    tokens, labels = batch()
    for _ in range(steps):
        engine.backward(causal_lm_loss(engine(tokens, parallel_output=True), labels, vocab_parallel=True))
        engine.step()


def full_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's fp32 master and moments, whole (gathered over data- and tensor-parallel ranks)."""
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed 0.19.8's ZeRO 1-2 link the fragments to the moments after stepping the first parameter
        # group only, leaving the others' unreachable by safe_get_full_optimizer_state; link them again
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    named = list(engine.module.named_parameters())
    gathered = {"fp32": {name: safe_get_full_fp32_param(p) for name, p in named}}
    for key in reshard.MOMENTS:
        gathered[key] = {name: safe_get_full_optimizer_state(p, key) for name, p in named}
    return {state: full(values, engine.module.arch) for state, values in gathered.items()}


def step_counts(engine) -> set[int]:
    optimizer = engine.optimizer
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    counts = {int(group["step"]) for group in optimizer.param_groups if "step" in group}
    counts |= {int(state["step"]) for state in optimizer.state.values() if "step" in state}
    return counts


def differences(expected: dict, got: dict) -> list[str]:
    return [f"{state} of {name}" for state in STATES for name, value in expected[state].items()
            if not torch.equal(got[state][name].view(torch.int32), value.view(torch.int32))]


def resume(args: NeoXArgs, seed: int):
    engine = trained_engine(args, seed)
    plan = plan_load(args, dist.get_world_size() // args.model_parallel_size)
    check(plan.shape_change is not None, f"the plan did not see the change of shape: {plan.describe()}")
    load_checkpoint(engine, plan)
    return engine, plan


def files_and_times(root: Path) -> list[tuple[str, int]]:
    return sorted((str(path), path.stat().st_mtime_ns) for path in root.rglob("*"))


def round_trip(work: Path, family: str, precision: str) -> dict:
    """Returns the state the TP 2 ZeRO-3 run saved."""
    first, second = work / f"{family}-{precision}-a", work / f"{family}-{precision}-b"
    args = settings(family, precision, 1, 1, save=str(first))
    engine = trained_engine(args, args.seed)
    train(engine, 2)
    saved = full_state(engine)
    save_checkpoint(args, engine, iteration=2, consumed_train_samples=12)
    if (family, precision) == ("neox", "bf16"):
        across_precisions(work, first, saved)

    args = settings(family, precision, 2, 3, load=str(first), save=str(second))
    files_before = files_and_times(work)
    engine, plan = resume(args, args.seed + 1)
    check(files_and_times(work) == files_before, "the resume at another shape wrote into the checkpoints")
    wanted = "optimizer state resharded from DP 2 x TP 1, ZeRO-1 to DP 1 x TP 2, ZeRO-3"
    check(wanted in plan.describe(), f"plan block lacks '{wanted}':\n{plan.describe()}")
    check(not differences(saved, full_state(engine)), f"{family} {precision} to TP 2 ZeRO-3: "
          f"{differences(saved, full_state(engine))[:3]} differ")
    check(step_counts(engine) == {2}, f"step counts {step_counts(engine)} after the resume, saved 2")
    train(engine, 1)
    saved = saved_at_tp2 = full_state(engine)
    save_checkpoint(args, engine, iteration=3, consumed_train_samples=15)

    args = settings(family, precision, 1, 1, load=str(second), save=str(work / f"{family}-{precision}-c"))
    engine, _ = resume(args, args.seed + 2)
    check(not differences(saved, full_state(engine)), f"{family} {precision} back to TP 1 ZeRO-1: "
          f"{differences(saved, full_state(engine))[:3]} differ")
    check(step_counts(engine) == {3}, f"step counts {step_counts(engine)} after the resume back, saved 3")
    train(engine, 1)  # the resumed engine trains on
    if dist.get_rank() == 0:
        report(case=f"{family} {precision}", ok=True)
    return saved_at_tp2


def across_precisions(work: Path, saved_dir: Path, saved: dict) -> None:
    """bf16 at DP 2, ZeRO-1 into fp32 at DP 1 x TP 2, ZeRO-2: the fp32 master and moments carry over as saved."""
    args = settings("neox", "fp32", 2, 2, load=str(saved_dir), save=str(work / "neox-bf16-to-fp32"))
    engine, plan = resume(args, args.seed + 5)
    check("bf16 to fp32" in plan.describe(), f"plan block does not name the precisions:\n{plan.describe()}")
    check(not differences(saved, full_state(engine)), f"bf16 to fp32: {differences(saved, full_state(engine))[:3]}")
    check(step_counts(engine) == {2}, f"step counts {step_counts(engine)} after bf16 to fp32, saved 2")
    if dist.get_rank() == 0:
        report(case="bf16 to fp32", ok=True)


def one_moment_left_unrestored_is_caught(work: Path, saved: dict) -> None:
    """The comparison above fails when one moment of one parameter keeps the fresh optimizer's value."""
    args = settings("llama", "fp32", 1, 1, load=str(work / "llama-fp32-b"), save=str(work / "sabotaged"))
    real_part = reshard.SavedOptimizerState.part

    def part_but_one(self, name, state):
        value = real_part(self, name, state)
        return torch.zeros_like(value) if (state, name) == ("exp_avg_sq", "sequential.2.mlp.linear1.weight") else value

    reshard.SavedOptimizerState.part = part_but_one
    try:
        engine, _ = resume(args, args.seed + 3)
    finally:
        reshard.SavedOptimizerState.part = real_part
    found = differences(saved, full_state(engine))
    check(found == ["exp_avg_sq of sequential.2.mlp.linear1.weight"], f"sabotage seen as {found}")
    if dist.get_rank() == 0:
        report(case="unrestored moment", caught=True)


def main() -> None:
    work = Path(sys.argv[1])
    deepspeed_logger.setLevel(logging.ERROR)
    init_deepspeed_distributed(dist_backend="gloo")
    check(dist.get_world_size() == 2, "expects 2 ranks")
    saved = {(family, precision): round_trip(work, family, precision)
             for family in ("neox", "llama") for precision in ("fp32", "bf16")}
    one_moment_left_unrestored_is_caught(work, saved["llama", "fp32"])
    dist.barrier()


if __name__ == "__main__":
    main()
    leave_process_group()
