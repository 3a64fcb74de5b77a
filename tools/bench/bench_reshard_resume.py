"""Full resume at another shape (reshard.py) against a same-shape full resume (DeepSpeed's own load).

    python tools/bench/bench_reshard_resume.py [--layers 12] [--hidden 768] [--heads 12] [--vocab 20480]
        [--seq 32] [--precision fp32|bf16] [--zero-stage 1] [--repeats 3] [--threads N] [--json PATH]

Saves one checkpoint at 1 data-parallel rank and one at 2 (a GPTModel, defaults: 100.8M parameters, in a real
DeepSpeed engine with Adam after one training step, saved with save_checkpoint), then in a gloo world of
2 ranks and in one of 1 rank times, the order alternating every repeat, the whole full resume
(plan_load + load_checkpoint) of each: the tag saved at this world's size (DeepSpeed's engine.load_checkpoint)
and the one saved at the other size (its shards read in memory by DeepSpeed's readers, module,
masters and moments written back). Prints the medians (the slowest rank's wall time) and the ratio lines
``RATIO reshard_1to2/same_shape_2 wall`` and ``RATIO reshard_2to1/same_shape_1 wall``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench_world as world  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import logger as deepspeed_logger  # noqa: E402
from harness import Ratios, bench_parser, in_turn, repeat_ratios, write_json  # noqa: E402

from megatron.checkpointing import load_checkpoint, plan_load, save_checkpoint  # noqa: E402
from megatron.logging import get_logger  # noqa: E402
from megatron.model import build_model  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.optim.optimizers import build_param_groups  # noqa: E402

MICRO_BATCH = 2
GLOBAL_BATCH = 4  # the same at 1 and 2 data-parallel ranks


def settings(options: argparse.Namespace, ranks: int, **paths) -> NeoXArgs:
    precision = {"bf16": {"enabled": True}} if options.precision == "bf16" else {}
    return NeoXArgs.from_dict(world.model_settings(
        options, train_micro_batch_size_per_gpu=MICRO_BATCH, train_batch_size=GLOBAL_BATCH, train_iters=10,
        num_gpus=ranks, precision=options.precision, zero_optimization={"stage": options.zero_stage},
        optimizer={"type": "Adam", "params": {"lr": 1e-4}}, **precision, **paths))


def engine_for(args: NeoXArgs):
    model = build_model(args.architecture(), args.seed)
    return world.build_engine(model, args.deepspeed_config(), build_param_groups(model, args.weight_decay))


def global_batch_step(engine, options: argparse.Namespace) -> None:
    tokens = torch.randint(0, options.vocab, (MICRO_BATCH, options.seq + 1), generator=torch.Generator().manual_seed(1))
    for _ in range(GLOBAL_BATCH // (MICRO_BATCH * dist.get_world_size())):
        world.train_step(engine, tokens)


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


@world.leaves_the_world
def rank_main(rank: int, ranks: int, port: int, options: argparse.Namespace, work: str, role: str, out: str) -> None:
    torch.set_num_threads(options.threads)
    world.init_world(rank, ranks, port)
    deepspeed_logger.setLevel(logging.ERROR)
    get_logger().setLevel(logging.WARNING)
    work_dir = Path(work)
    if role == "save":
        args = settings(options, ranks, save=str(work_dir / f"saved-by-{ranks}"))
        engine = engine_for(args)
        global_batch_step(engine, options)
        save_checkpoint(args, engine, iteration=1, consumed_train_samples=GLOBAL_BATCH)
        return
    other = 2 if ranks == 1 else 1
    loads = {"same_shape": work_dir / f"saved-by-{ranks}", "reshard": work_dir / f"saved-by-{other}"}
    engine = engine_for(settings(options, ranks))
    times: dict[str, list[float]] = {name: [] for name in loads}
    for repeat in range(options.repeats):
        for name in in_turn(list(loads), repeat):
            args = settings(options, ranks, load=str(loads[name]), save=str(work_dir / f"scratch-{ranks}"))
            dist.barrier()
            start = time.perf_counter()
            plan = plan_load(args, ranks)
            load_checkpoint(engine, plan)
            times[name].append(slowest(time.perf_counter() - start))
            if (plan.shape_change is not None) != (name == "reshard"):
                raise AssertionError(f"{name}: the plan {'did not see' if name == 'reshard' else 'saw'} a change of shape")
    if rank == 0:
        medians = {name: statistics.median(values) for name, values in times.items()}
        Path(out).write_text(json.dumps({**medians, "per_repeat": times,
                                         "parameters": sum(p.numel() for p in engine.module.parameters())}))


def run_world(ranks: int, options: argparse.Namespace, work: str, role: str) -> dict[str, float]:
    out = str(Path(work) / f"{role}-{ranks}.json")
    torch.multiprocessing.spawn(rank_main, args=(ranks, world.free_port(), options, work, role, out), nprocs=ranks)
    return json.loads(Path(out).read_text()) if role == "load" else {}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=12, hidden=768, heads=12, vocab=20480, seq=32, precision="fp32",
                          zero_stage=1, zero_stages=(1, 2, 3), repeats=3, threads=1)
    options = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    os.environ.setdefault("OMP_NUM_THREADS", str(options.threads))
    with tempfile.TemporaryDirectory(prefix="bench_reshard_") as work:
        for ranks in (1, 2):
            run_world(ranks, options, work, "save")
        medians = {ranks: run_world(ranks, options, work, "load") for ranks in (2, 1)}
    load_average = (load_before, os.getloadavg()[0])
    parameters = medians[1]["parameters"]
    print(f"model: {parameters:,} parameters, {options.precision}, ZeRO-{options.zero_stage}, global batch {GLOBAL_BATCH}")
    for ranks, values in medians.items():
        print(f"{ranks} rank(s): same-shape full resume {values['same_shape']:.2f} s, resharded from "
              f"{3 - ranks} rank(s) {values['reshard']:.2f} s (median of {options.repeats}, slowest rank)")
    ratios = Ratios()

    def per_repeat(ranks: int) -> list[float]:
        times = medians[ranks]["per_repeat"]
        return repeat_ratios(times["reshard"], times["same_shape"])

    ratios.add("reshard_1to2/same_shape_2 wall", medians[2]["reshard"], medians[2]["same_shape"],
               "full resume of a 1-rank save on 2 ranks against a 2-rank save on 2 ranks", per_repeat(2))
    ratios.add("reshard_2to1/same_shape_1 wall", medians[1]["reshard"], medians[1]["same_shape"],
               "full resume of a 2-rank save on 1 rank against a 1-rank save on 1 rank", per_repeat(1))
    write_json(options, __doc__, ratios, load_average, parameters=parameters, medians=medians)
    return 0


if __name__ == "__main__":
    sys.exit(main())
