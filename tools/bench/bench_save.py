"""A save's cost to training: synchronous, asynchronous (async_save) and without optimizer states.

    python tools/bench/bench_save.py [--ranks 1|2] [--layers 12] [--hidden 768] [--heads 12] [--vocab 32768]
        [--precision bf16|fp32] [--zero-stage 1] [--repeats 3] [--batch 1] [--seq 32] [--threads N]
        [--save-dir DIR] [--json PATH]

Builds a GPTModel (defaults: 110M parameters) in a real DeepSpeed engine with Adam on a gloo world of
``--ranks`` processes on this machine, trains a few steps to time a step, then per repeat (the order
rotating) saves through ``save_checkpoint`` into ``--save-dir`` (a temporary folder by default;
keep_last_n_checkpoints 1):

* ``synchronous``: the whole save (files, fsync, checksum manifest, rename, `latest`) while training waits;
* ``async``: ``save_checkpoint`` with async_save (the state copied to host memory), then training
  steps, each followed by the per-step ``check_save_in_flight``, until the save is committed (at most
  ``--max-steps-in-flight`` steps, then ``wait_for_save_in_flight``). **blocked** is the time training
  waited: the call plus that final wait; **slowed steps** is how much longer the steps during the
  save took than steps without one (the background thread shares this machine's CPUs with training);
* ``no_save_optim``: the synchronous save of the same state without optimizer states.

Before the repeats, untimed, one save of each kind measured for RSS growth (rank 0's; the asynchronous one
from its call until committed): its peak, and what it keeps; the first asynchronous save allocates the
host buffers that the later ones copy into (snapshot_engine.py), so the timed repeats are those of a
run's later saves, and the first one's pause is printed apart. Prints the slowest rank's medians, and
``RATIO`` lines: ``blocked/synchronous wall`` (the goal: at most 0.1), ``first_async/synchronous wall``,
``slowed_steps/synchronous wall``, ``no_save_optim/synchronous wall``, ``async peak_rss/tag size`` and
``async kept_rss/tag size`` (the host copy against the rank's share of the tag; a synchronous save
grows RSS by little).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench_world as world  # noqa: E402
import torch  # noqa: E402
from harness import Ratios, bench_parser, in_turn, repeat_ratios, slowest_rank, table, write_json  # noqa: E402
from procmem import measure_memory  # noqa: E402

from megatron.checkpointing import (  # noqa: E402
    Lineage,
    check_save_in_flight,
    newest_tag_size,
    save_checkpoint,
    save_in_flight,
    saves_waited_for,
    wait_for_save_in_flight,
)
from megatron.logging import get_logger  # noqa: E402
from megatron.model import build_model  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.runtime.collective import all_gather, barrier  # noqa: E402

KINDS = ("synchronous", "async", "no_save_optim")


def run_args(options: argparse.Namespace, save_dir: Path, **kind) -> NeoXArgs:
    return NeoXArgs.from_dict(world.model_settings(
        options, num_gpus=options.ranks, save=str(save_dir), keep_last_n_checkpoints=1,
        config_files={"bench.yml": "num_layers: 8\n"}, **kind))


class Saves:
    """The three kinds of save, each at the next iteration (one lineage, so older tags are pruned)."""

    def __init__(self, options, save_dir: Path, engine, tokens):
        self.args = {"synchronous": run_args(options, save_dir, async_save=False),
                     "async": run_args(options, save_dir, async_save=True),
                     "no_save_optim": run_args(options, save_dir, no_save_optim=True, async_save=False)}
        self.engine, self.tokens, self.options = engine, tokens, options
        self.lineage = Lineage()
        self.iteration = 0
        self.steps_without_save: list[float] = []

    def step(self, save_in_flight: bool = False) -> float:
        started = time.perf_counter()
        world.train_step(self.engine, self.tokens)
        seconds = time.perf_counter() - started
        if not save_in_flight:
            self.steps_without_save.append(seconds)
        return seconds

    def save(self, kind: str) -> None:
        self.iteration += 1
        save_checkpoint(self.args[kind], self.engine, self.iteration, self.iteration, lineage=self.lineage)

    def timed(self, kind: str) -> dict[str, float]:
        barrier()
        started = time.perf_counter()
        self.save(kind)
        called = time.perf_counter() - started
        if kind != "async":
            return {"wall": called}
        steps, stepped = 0, 0.0
        while steps < self.options.max_steps_in_flight and save_in_flight():
            stepped += self.step(save_in_flight=True)
            steps += 1
            check_save_in_flight()
        started = time.perf_counter()
        wait_for_save_in_flight()
        waited = time.perf_counter() - started
        return {"wall": called + waited, "call": called, "waited": waited, "steps": steps, "stepped": stepped}

    def memory(self, kind: str) -> dict[str, float]:
        """RSS growth of one save of `kind` from its call until committed: at the peak, and kept after it;
        the wall time training waited for it (the call; for an asynchronous save, the host copy)."""
        called = 0.0

        def save_until_committed():
            nonlocal called
            started = time.perf_counter()
            self.save(kind)
            called = time.perf_counter() - started
            wait_for_save_in_flight()

        barrier()
        delta = measure_memory(save_until_committed)[1]
        return {"peak": delta.peak_growth_mib, "kept": delta.retained_mib, "call": called}


def measure_rank(options: argparse.Namespace, save_dir: Path) -> dict:
    args = run_args(options, save_dir)
    engine = world.build_engine(build_model(args.architecture(), args.seed),
                                world.deepspeed_config(options.batch, options.zero_stage, options.precision))
    n_params = sum(p.numel() for p in engine.module.parameters())
    tokens = torch.randint(0, options.vocab, (options.batch, options.seq + 1),
                           generator=torch.Generator().manual_seed(0))
    saves = Saves(options, save_dir, engine, tokens)
    saves.step()  # warm-up: the optimizer state exists from here on
    saves.steps_without_save.clear()
    for _ in range(2):
        saves.step()
    memory = {kind: saves.memory(kind) for kind in ("synchronous", "async")}  # the first async save ever
    tag_bytes = newest_tag_size(save_dir)[1]  # a full save's (the async one just committed)
    results: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for repeat in range(options.repeats):
        for kind in in_turn(KINDS, repeat):
            results[kind].append(saves.timed(kind))
            saves.step()
    step_seconds = median(saves.steps_without_save)  # steps between the saves, as loaded as the others
    for run in results["async"]:
        run["slowed_steps"] = max(run.pop("stepped") - run["steps"] * step_seconds, 0.0)
    medians = {kind: {key: median([r[key] for r in runs]) for key in runs[0]} for kind, runs in results.items()}
    return {"parameters": n_params, "step_seconds": step_seconds, "medians": medians,
            "spread": {kind: [r["wall"] for r in runs] for kind, runs in results.items()},
            "memory": memory, "tag_mib": tag_bytes / 2**20, "threads": torch.get_num_threads()}


@world.leaves_the_world
def rank_main(rank: int, options: argparse.Namespace, port: int, save_dir: str, out: str) -> None:
    world.measuring_process(options.threads)
    get_logger().setLevel("WARNING")
    world.init_world(rank, options.ranks, port)
    with saves_waited_for():  # as the training loop: async_save saves go to the background
        result = measure_rank(options, Path(save_dir))
    gathered = all_gather(result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


def report(options: argparse.Namespace, ranks: list[dict], load_average: tuple[float, float]) -> dict:
    first = ranks[0]

    def slowest(kind: str, key: str) -> float:
        return max(r["medians"][kind][key] for r in ranks)

    def per_repeat(kind: str) -> list[float]:
        return slowest_rank([r["spread"][kind] for r in ranks])

    def against_synchronous(kind: str) -> list[float]:
        return repeat_ratios(per_repeat(kind), per_repeat("synchronous"))

    print(f"model: {first['parameters'] / 1e6:.1f}M parameters, {options.layers} layers, hidden {options.hidden}, "
          f"vocab {options.vocab}; {options.precision}, ZeRO stage {options.zero_stage}, Adam; {options.ranks} "
          f"rank(s) on this machine; tag {first['tag_mib']:.0f} MiB (a full save); train step "
          f"{1e3 * max(r['step_seconds'] for r in ranks):.0f} ms (batch {options.batch} x {options.seq} tokens)")
    print(f"torch threads {first['threads']} per rank, {os.cpu_count()} CPUs; repeats {options.repeats}; "
          f"load average before {load_average[0]:.2f}, after {load_average[1]:.2f}")
    rows = [[kind, 1e3 * slowest(kind, "wall"), " ".join(f"{1e3 * wall:.0f}" for wall in per_repeat(kind))]
            for kind in KINDS]
    print(table(["save", "training blocked ms (median)", "per repeat ms"], rows))
    print(f"async: call {1e3 * slowest('async', 'call'):.0f} ms, final wait {1e3 * slowest('async', 'waited'):.0f} ms, "
          f"{slowest('async', 'steps'):.0f} steps while in flight, slowed by {1e3 * slowest('async', 'slowed_steps'):.0f} ms "
          f"in all; the first async save (allocating its host buffers) blocked "
          f"{1e3 * max(r['memory']['async']['call'] for r in ranks):.0f} ms")
    print(f"RSS growth (rank 0), peak / kept: synchronous {first['memory']['synchronous']['peak']:.0f} / "
          f"{first['memory']['synchronous']['kept']:.0f} MiB, first async {first['memory']['async']['peak']:.0f} / "
          f"{first['memory']['async']['kept']:.0f} MiB")
    ratios = Ratios()
    ratios.add("blocked/synchronous wall", slowest("async", "wall"), slowest("synchronous", "wall"),
               "training time an async_save blocks, against a synchronous save of the same state",
               against_synchronous("async"))
    ratios.add("first_async/synchronous wall", max(r["memory"]["async"]["call"] for r in ranks),
               slowest("synchronous", "wall"), "the pause of a run's first async_save, which allocates the host buffers")
    ratios.add("slowed_steps/synchronous wall", slowest("async", "slowed_steps"), slowest("synchronous", "wall"),
               "extra time of the steps run while the background thread writes, against the synchronous save")
    ratios.add("no_save_optim/synchronous wall", slowest("no_save_optim", "wall"), slowest("synchronous", "wall"),
               "a synchronous save without optimizer states, against the full one",
               against_synchronous("no_save_optim"))
    share = first["tag_mib"] / options.ranks
    ratios.add("async peak_rss/tag size", first["memory"]["async"]["peak"], share,
               "rank 0's peak RSS growth from a first async save's call until committed, against its share of the tag")
    ratios.add("async kept_rss/tag size", first["memory"]["async"]["kept"], share,
               "host memory rank 0 keeps after it for the next async save, against its share of the tag")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, ranks=1, layers=12, hidden=768, heads=12, vocab=32768, seq=32, precision="bf16",
                          zero_stage=1, repeats=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-steps-in-flight", type=int, default=20,
                        help="training steps run while an asynchronous save is written, at most")
    parser.add_argument("--save-dir", type=Path, help="where the tags go (default: a temporary folder, removed)")
    options = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="bench_save_"))
    save_dir = options.save_dir or scratch / "checkpoints"
    load_before = os.getloadavg()[0]
    try:
        port, out = world.free_port(), str(scratch / "ranks.json")
        if options.ranks == 1:
            rank_main(0, options, port, str(save_dir), out)
        else:
            torch.multiprocessing.spawn(rank_main, args=(options, port, str(save_dir), out), nprocs=options.ranks)
        ranks = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load_average = (load_before, os.getloadavg()[0])
    write_json(options, __doc__, report(options, ranks, load_average), load_average, ranks=ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
