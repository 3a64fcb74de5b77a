"""Host memory per rank of building a ZeRO-3 model and loading a checkpoint into it: partitioned against whole.

    python tools/bench/bench_zero3_build.py [--ranks 2] [--layers 24] [--hidden 1280] [--heads 16]
        [--vocab 50304] [--seq 32] [--precision bf16] [--threads N] [--json PATH]

First one gloo world of ``--ranks`` processes builds the model (another seed), starts a ZeRO-3 engine
and saves a checkpoint as training does (full fp32 module file, manifest), measuring the save. Then,
once per way of building, a fresh world of ``--ranks`` processes, each rank:

1. builds the model: ``partitioned`` is what training does under ZeRO-3 (``build_model`` with a
   ``deepspeed.zero.Init`` context), ``whole`` what it did before (the whole fp32 model on every rank,
   partitioned only by ``deepspeed.initialize``);
2. starts a ZeRO-3 engine on it (with SGD: an optimizer without state, so the engine's own memory
   is its fp32 master and gradient partitions, the same for both ways);
3. loads the checkpoint module-only (``read_module_weights`` + ``load_module_only``, master refresh
   and verification included) and checks two parameters against the checkpoint.

Memory is the rank's anonymous memory (smaps_rollup ``Anonymous``): what the rank allocated itself.
The pages of the memory-mapped checkpoint are left out; they belong to the page cache, which the
kernel can drop. "build + load" is the most the model's weights needed at any moment of steps 1 and 3:
max(peak during the build, held after the build + peak growth during the load), printed in MiB and
as a fraction of the full fp32 model (4 bytes per parameter); the engine's start (step 2) is shown
beside it. ``RATIO`` lines and ``--json`` as in the other benches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench_world as world  # noqa: E402
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import Ratios, bench_parser, table, write_json  # noqa: E402
from procmem import PeakSampler, smaps_rollup_kib  # noqa: E402

from megatron.checkpointing import (  # noqa: E402
    load_module_only,
    read_module_weights,
    save_engine_checkpoint,
    write_tag,
)
from megatron.model import build_model  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.runtime.initialize import zero3_construction  # noqa: E402

TAG = "global_step1"
BUILDS = ("partitioned", "whole")
SEED = 1234
CHECKPOINT_SEED = SEED + 1  # the checkpoint holds other weights than a fresh build, so a load must change them


def architecture(options: argparse.Namespace):
    return NeoXArgs.from_dict(world.model_settings(options, seed=SEED)).architecture()


def ds_config(options: argparse.Namespace) -> dict:
    return world.deepspeed_config(1, 3, options.precision, optimizer="SGD", lr=1e-3,
                                  zero_allow_untested_optimizer=True)


def build(options: argparse.Namespace, how: str, seed: int):
    partitioned_by = zero3_construction(ds_config(options)) if how == "partitioned" else None
    return build_model(architecture(options), seed, partitioned_by=partitioned_by)


def start_engine(options: argparse.Namespace, model):
    return world.build_engine(model, ds_config(options))


def anonymous_mib() -> float:
    return (smaps_rollup_kib() or {}).get("Anonymous", 0) / 1024


def save_checkpoint(options: argparse.Namespace, save_dir: Path) -> dict:
    """Save as training does; returns the peak anonymous memory growth of the save on this rank."""
    engine = start_engine(options, build(options, "partitioned", CHECKPOINT_SEED))
    dist.barrier()
    save_peak = {}

    def write_files(partial: Path):
        failure, save_peak["mib"] = PeakSampler(fields=("Anonymous",)).measure(
            lambda: save_engine_checkpoint(engine, save_dir, partial.name, {"iteration": 1}))
        return failure

    write_tag(save_dir, TAG, 1, write_files)  # committed as a run's save is
    return {"save_peak_mib": save_peak["mib"]}


def check_loaded(engine, weights: dict[str, torch.Tensor]) -> None:
    """The first and last parameters hold the checkpoint's values after the load."""
    params = list(engine.module.named_parameters())
    for name, param in (params[0], params[-1]):
        with deepspeed.zero.GatheredParameters([param]):
            if not torch.equal(param.data, weights[name].to(param.dtype)):
                raise SystemExit(f"parameter {name} differs from the checkpoint after the load")


def measure_rank(options: argparse.Namespace, how: str, save_dir: Path) -> dict:
    sampler = PeakSampler(fields=("Anonymous",))
    dist.barrier()
    start = anonymous_mib()
    wall = time.perf_counter()
    model, build_peak = sampler.measure(lambda: build(options, how, SEED))
    build_s, held_after_build = time.perf_counter() - wall, anonymous_mib() - start
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    dist.barrier()
    before_engine = anonymous_mib()
    engine, engine_peak = sampler.measure(lambda: start_engine(options, model))
    engine_held = anonymous_mib() - before_engine
    dist.barrier()
    wall = time.perf_counter()
    tag_dir = save_dir / TAG
    _, load_peak = sampler.measure(lambda: load_module_only(engine, read_module_weights(tag_dir), strict=True))
    load_s = time.perf_counter() - wall
    check_loaded(engine, read_module_weights(tag_dir))
    return {"parameters": n_params, "build_peak_mib": build_peak, "held_after_build_mib": held_after_build,
            "engine_peak_mib": engine_peak, "engine_held_mib": engine_held, "load_peak_mib": load_peak,
            "build_plus_load_mib": max(build_peak, held_after_build + load_peak), "build_s": build_s,
            "load_s": load_s}


@world.leaves_the_world
def rank_main(rank: int, options: argparse.Namespace, port: int, scratch: str, task: str) -> None:
    world.measuring_process(options.threads)
    world.init_world(rank, options.ranks, port)
    save_dir = Path(scratch) / "checkpoint"
    result = save_checkpoint(options, save_dir) if task == "save" else measure_rank(options, task, save_dir)
    (Path(scratch) / f"{task}-rank{rank}.json").write_text(json.dumps(result))


def run_world(options: argparse.Namespace, scratch: str, task: str) -> None:
    torch.multiprocessing.spawn(rank_main, args=(options, world.free_port(), scratch, task), nprocs=options.ranks)


def report(options: argparse.Namespace, results: dict[str, list[dict]], load_average: tuple[float, float]) -> dict:
    n_params = results["partitioned"][0]["parameters"]
    fp32_mib = 4 * n_params / 2**20
    print(f"model: {n_params / 1e6:.1f}M parameters ({fp32_mib:.0f} MiB in fp32), {options.layers} layers, hidden "
          f"{options.hidden}, vocab {options.vocab}; {options.precision}, ZeRO stage 3, {options.ranks} rank(s) on "
          f"this machine, {os.cpu_count()} CPUs; load average before {load_average[0]:.2f}, after {load_average[1]:.2f}")
    rows = []
    for how in BUILDS:
        for rank, r in enumerate(results[how]):
            rows.append([how, rank, r["build_peak_mib"], r["held_after_build_mib"], r["load_peak_mib"],
                         r["build_plus_load_mib"], r["build_plus_load_mib"] / fp32_mib, r["engine_peak_mib"],
                         r["build_s"], r["load_s"]])
    print(table(["build", "rank", "build peak MiB", "held after build MiB", "load peak growth MiB",
                 "build + load MiB", "build + load / fp32 model", "engine start peak MiB", "build s", "load s"],
                rows))
    ratios = Ratios()
    ratio = ratios.add

    def worst(how: str, key: str) -> float:
        return max(r[key] for r in results[how])

    ratio("partitioned build+load/fp32 model", worst("partitioned", "build_plus_load_mib"), fp32_mib,
          "most anonymous memory any rank's weights needed while building and loading, against the whole fp32 model")
    ratio("whole build+load/fp32 model", worst("whole", "build_plus_load_mib"), fp32_mib,
          "the same when every rank builds the whole model first")
    ratio("partitioned/whole build+load", worst("partitioned", "build_plus_load_mib"),
          worst("whole", "build_plus_load_mib"), "partitioned construction against the whole build")
    ratio("save peak/fp32 model", worst("save", "save_peak_mib"), fp32_mib,
          "most anonymous memory a rank needed while saving (DP rank 0 writes the full fp32 module file)")
    ratio("partitioned/whole build wall", worst("partitioned", "build_s"), worst("whole", "build_s"),
          "time to build (draws, and the partitioning's broadcasts)")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, ranks=2, layers=24, hidden=1280, heads=16, vocab=50304, seq=32, precision="bf16")
    options = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_zero3_build_") as scratch:
        results = {}
        for how in ("save", *BUILDS):
            run_world(options, scratch, how)
            results[how] = [json.loads((Path(scratch) / f"{how}-rank{r}.json").read_text())
                            for r in range(options.ranks)]
    load_average = (load_before, os.getloadavg()[0])
    write_json(options, __doc__, report(options, results, load_average), load_average, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
