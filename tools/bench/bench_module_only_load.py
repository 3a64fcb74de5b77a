"""Module-only load: ours (read_module_weights + load_module_only) against DeepSpeed's own and a raw read.

    python tools/bench/bench_module_only_load.py [--ranks 1|2] [--tp 1] [--saved-tp N] [--layers 4]
        [--hidden 512] [--vocab 16384] [--precision bf16] [--zero-stage 1] [--repeats 5] [--batch 1]
        [--seq 32] [--threads N] [--cold] [--json PATH]

(fp16 needs an accelerator that supports it: DeepSpeed's CPU accelerator refuses it.)

Builds a GPTModel inside a real DeepSpeed engine (a gloo world of ``--ranks`` processes on this
machine, ``--tp`` of them per tensor-parallel group, the rest data parallel), saves one checkpoint
with save_engine_checkpoint, then, rotating the order every repeat, measures on every rank at once:

* baseline: ``engine.load_checkpoint(dir, tag, load_module_only=True, load_optimizer_states=False,
  load_lr_scheduler_states=False)``;
* ours: ``read_module_weights(tag_dir)`` + ``load_module_only(engine, weights)`` (the master refresh, which
  checks every master element in the same pass, included);
* raw (ZeRO 0-2): ``torch.load(model file, mmap=True)`` + ``module.load_state_dict``: the floor any
  load has to pay, though it leaves the optimizer's master weights stale;
* ``verify_master_weights(engine)`` alone (the refresh's check without its writes), against one training
  step (forward + backward + step);
* the manifest check alone (the XXH3-64 of the model-states file against the tag's manifest.json), which
  ``read_module_weights`` runs before reading, so it is part of "ours";
* with ``--cold`` (every file of the tag evicted from the page cache with ``posix_fadvise(DONTNEED)`` before
  each load, as for the first read of a restarted job): read_evicted, a plain read of the evicted module
  file, and read_cached, the same read again from the page cache; ``RATIO read_evicted/read_cached`` above
  1 shows the eviction worked;
* resplit (with ``--saved-tp`` other than ``--tp``): ours from a checkpoint an engine at tensor-parallel
  size ``--saved-tp`` saved first: every saved rank's file read (memory-mapped), this rank's slices
  taken with ``repartition_state_dict`` as a run's module-only load takes them, then
  ``load_module_only``; its ratio to "ours" is the load-time cost of changing the tensor-parallel size.

A training step runs before every load so each load has changed weights to overwrite; after the
first loads of each kind the engine's weights are checked against the checkpoint. Prints medians
(wall and process CPU time; the slowest rank's), peak RSS growth (rank 0), the node's peak private
memory and PSS growth (all ranks added up; sampled on a thread during a second, untimed run of each
call, since the sampling slows the call it watches), and ``RATIO`` lines; ``--json`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench_world as world  # noqa: E402
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import (  # noqa: E402
    Ratios,
    bench_parser,
    in_turn,
    middle_half,
    repeat_ratios,
    slowest_rank,
    table,
    write_json,
)  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from procmem import PeakSampler, measure_memory  # noqa: E402

from megatron.checkpointing import (  # noqa: E402
    checks_beside_use,
    forget_checked_files,
    load_module_only,
    model_states_name,
    read_module_weights,
    save_engine_checkpoint,
    verify_files,
    verify_master_weights,
    write_tag,
)
from megatron.checkpointing import load_file_weights_only as load_weights_only  # noqa: E402
from megatron.model import build_model  # noqa: E402
from megatron.model.partitioning import repartition_state_dict  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402

TAG = "global_step1"


def tensor_parallel_engine(options: argparse.Namespace, tensor_parallel_size: int):
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_parallel_size, 1)
    args = NeoXArgs.from_dict(world.model_settings(options, model_parallel_size=tensor_parallel_size,
                                                   num_gpus=options.ranks))
    return world.build_engine(build_model(args.architecture(), args.seed),
                              world.deepspeed_config(options.batch, options.zero_stage, options.precision, lr=1e-3))


def trained_weights(engine) -> dict[str, torch.Tensor]:
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.data.detach().cpu().clone() for name, p in params.items()}


def check_loaded(engine, checkpoint: dict[str, torch.Tensor], what: str) -> None:
    """The engine holds the checkpoint's weights (cast to the training dtype); a load that did nothing fails."""
    for name, value in trained_weights(engine).items():
        if not torch.equal(value, checkpoint[name].to(value.dtype)):
            raise SystemExit(f"{what}: parameter {name} differs from the checkpoint after the load")


def evict_from_page_cache(tag_dir: Path) -> None:
    """Drop the tag's files from the page cache, so the next load reads them from the disk."""
    for path in tag_dir.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_whole_file(path: Path) -> None:
    buffer = bytearray(1 << 20)
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass


def timed(call) -> dict[str, float]:
    """Run ``call`` once: wall and CPU seconds, RSS peak and kept growth (MiB). The caller collects garbage
    first (``gc.collect()``, or collected_at_barrier where the ranks start together), so that no collection
    of earlier garbage falls inside the timing."""
    wall, cpu = time.perf_counter(), time.process_time()
    _, rss = measure_memory(call)
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "peak_rss": rss.peak_growth_mib,
            "kept_rss": rss.retained_mib}


def collected_at_barrier() -> None:
    """Collect garbage, then wait for every rank: the ranks' timed loads start together. A collection walks
    every object the interpreter tracks (some ms here, more on one rank than another), so one run between the
    barrier and the timing staggered the ranks' starts, and each rank timed a load that had the disk, or the
    node's check of the file, to itself for a while."""
    gc.collect()
    dist.barrier()


def timed_then_sampled(call) -> dict[str, float]:
    """``timed(call)``, then the private and PSS peak growth (MiB) of a second, untimed run: the sampling
    thread slows the call it watches several-fold (the raw read 9 ms -> 83 ms here)."""
    sample = timed(call)
    gc.collect()
    _, sample["peak_private"], sample["peak_pss"] = PeakSampler().measure(call)
    return sample


def trained_and_saved(options: argparse.Namespace, tensor_parallel_size: int, save_dir: Path, tokens: torch.Tensor):
    """An engine at ``tensor_parallel_size`` after one training step, and the tag it saved in ``save_dir``."""
    engine = tensor_parallel_engine(options, tensor_parallel_size)
    world.train_step(engine, tokens.to(engine.device))  # warm-up, and optimizer state exists as in a real run
    # committed as a run's save is (DeepSpeed's own ZeRO-3 module-only load reads `latest`)
    tag_dir = write_tag(save_dir, TAG, 1, lambda partial: save_engine_checkpoint(
        engine, save_dir, partial.name, {"iteration": 1}))
    return engine, tag_dir


def measure_rank(options: argparse.Namespace, save_dir: Path) -> dict:
    """Everything one rank measures; every rank runs it at the same time (loads start at a barrier)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, options.vocab, (options.batch, options.seq + 1), generator=generator)
    resplit_tag = None
    if options.saved_tp != options.tp:
        _, resplit_tag = trained_and_saved(options, options.saved_tp, save_dir / f"tp{options.saved_tp}", tokens)
        gc.collect()
    engine, tag_dir = trained_and_saved(options, options.tp, save_dir, tokens)
    tokens = tokens.to(engine.device)
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    mp_rank = parallel_state.get_tensor_model_parallel_rank()
    module_file = tag_dir / model_states_name(mp_rank)
    checkpoint = {k: v.clone() for k, v in read_module_weights(tag_dir, mp_rank).items()}

    def baseline():
        path, _ = engine.load_checkpoint(str(save_dir), TAG, load_module_only=True,
                                         load_optimizer_states=False, load_lr_scheduler_states=False)
        if path is None:
            raise SystemExit(f"DeepSpeed's load_checkpoint loaded nothing from {save_dir}/{TAG}")

    def ours():
        with checks_beside_use():  # as load.py loads
            load_module_only(engine, read_module_weights(tag_dir, mp_rank), strict=True)

    def resplit_weights():
        parts = [read_module_weights(resplit_tag, mp) for mp in range(options.saved_tp)]
        return repartition_state_dict(parts, engine.module.arch, mp_rank, options.tp)

    def resplit():
        load_module_only(engine, resplit_weights(), strict=True)

    def raw():
        state = load_weights_only(module_file)["module"]  # no manifest check: the floor
        engine.module.load_state_dict(state, strict=False)  # without the megatron-core _extra_state keys

    loads = {"baseline": baseline, "ours": ours}
    expected = {"baseline": checkpoint, "ours": checkpoint}
    if resplit_tag is not None:
        loads["resplit"] = resplit
        expected["resplit"] = {k: v.clone() for k, v in resplit_weights().items()}
    if options.zero_stage < 3:  # a ZeRO-3 module holds partitions; load_state_dict cannot fill them
        loads["raw"] = raw
    samples: dict[str, list[dict]] = {name: [] for name in loads}
    samples.update(verify=[], checksum=[], train_step=[])
    if options.cold:  # the eviction works where a read of the evicted file is slower than one from the cache
        samples.update(read_evicted=[], read_cached=[])
    for repeat in range(options.repeats):
        if options.cold:
            evict_from_page_cache(tag_dir)
            collected_at_barrier()
            samples["read_evicted"].append(timed(lambda: read_whole_file(module_file)))
            samples["read_cached"].append(timed(lambda: read_whole_file(module_file)))
        for name in in_turn(list(loads), repeat):
            load = loads[name]
            gc.collect()
            samples["train_step"].append(timed(lambda: world.train_step(engine, tokens)))
            if options.cold:
                evict_from_page_cache(tag_dir)
            forget_checked_files()  # every repeat checks the files, as each restarted run does
            collected_at_barrier()
            samples[name].append(timed_then_sampled(load))
            if repeat < 2 and name != "raw":  # raw leaves the master stale: it is a floor, not a load
                check_loaded(engine, expected[name], name)
            if name == "ours":
                gc.collect()
                samples["verify"].append(timed_then_sampled(lambda: verify_master_weights(engine)))
                gc.collect()
                samples["checksum"].append(timed_then_sampled(lambda: verify_files(tag_dir, [module_file])))
    files_mib = sum(p.stat().st_size for p in tag_dir.iterdir() if p.is_file()) / 2**20
    medians = {name: {key: median([s[key] for s in runs]) for key in runs[0]} for name, runs in samples.items()}
    return {"parameters": n_params, "checkpoint_mib": files_mib, "medians": medians,
            "walls": {name: [s["wall"] for s in runs] for name, runs in samples.items()},
            "threads": torch.get_num_threads()}


@world.leaves_the_world
def rank_main(rank: int, options: argparse.Namespace, port: int, scratch: str) -> None:
    world.init_world(rank, options.ranks, port)
    result = measure_rank(options, Path(scratch) / "checkpoint")
    (Path(scratch) / f"rank{rank}.json").write_text(json.dumps(result))


def spawned_rank(rank: int, options: argparse.Namespace, port: int, scratch: str) -> None:
    world.measuring_process(options.threads)
    rank_main(rank, options, port, scratch)


def per_repeat_ratios(ranks: list[dict], numerator: str, denominator: str) -> list[float]:
    """Each repeat's ratio of the slowest rank's walls (the loads of a repeat run one right after the other)."""
    def slowest(name: str) -> list[float]:
        return slowest_rank([r["walls"][name] for r in ranks])

    return repeat_ratios(slowest(numerator), slowest(denominator))


def report(options: argparse.Namespace, ranks: list[dict], load_average: tuple[float, float],
           malloc_returns_memory: bool) -> dict:
    first = ranks[0]
    names = list(first["medians"])

    def slowest(name: str, key: str) -> float:
        return max(r["medians"][name][key] for r in ranks)

    def node(name: str, key: str) -> float | str:  # "-" where not sampled (the training step)
        return sum(r["medians"][name][key] for r in ranks) if key in first["medians"][name] else "-"

    print(f"model: {first['parameters'] / 1e6:.1f}M parameters, {options.layers} layers, hidden {options.hidden}, "
          f"vocab {options.vocab}; {options.precision}, ZeRO stage {options.zero_stage}, {options.ranks} rank(s) "
          f"on this machine, tensor-parallel size {options.tp}"
          f"{f' (resplit: saved at {options.saved_tp})' if options.saved_tp != options.tp else ''}; checkpoint tag {first['checkpoint_mib']:.1f} MiB; train step: batch {options.batch} "
          f"x {options.seq} tokens; {'files evicted from the page cache before each load' if options.cold else 'files in the page cache'}")
    print(f"torch threads {first['threads']} per rank, {os.cpu_count()} CPUs; repeats {options.repeats}; "
          f"load average before {load_average[0]:.2f}, after {load_average[1]:.2f}")
    if not malloc_returns_memory:
        print("glibc mallopt unavailable: freed memory may be reused unseen, peak RSS growth may read low")
    rows = [[name, 1e3 * slowest(name, "wall"), 1e3 * slowest(name, "cpu"), first["medians"][name]["peak_rss"],
             node(name, "peak_private"), node(name, "peak_pss")] for name in names]
    print(table(["measured", "wall ms", "cpu ms", "rank 0 peak RSS MiB", "node peak private MiB",
                 "node peak PSS MiB"], rows))
    ratios = Ratios()
    ratio = ratios.add

    def per_repeat(numerator: str, denominator: str) -> list[float]:
        return per_repeat_ratios(ranks, numerator, denominator)

    ratio("ours/baseline wall", slowest("ours", "wall"), slowest("baseline", "wall"), "module-only load time",
          per_repeat("ours", "baseline"))
    ratio("ours/baseline cpu", slowest("ours", "cpu"), slowest("baseline", "cpu"), "module-only load CPU time")
    ratio("ours/baseline peak_rss", first["medians"]["ours"]["peak_rss"], first["medians"]["baseline"]["peak_rss"],
          "rank 0's peak RSS growth during the load")
    ratio("ours/baseline node_private", node("ours", "peak_private"), node("baseline", "peak_private"),
          "private memory the node's ranks need at their peaks during the load")
    ratio("verify/train_step wall", slowest("verify", "wall"), slowest("train_step", "wall"),
          "verify_master_weights against one forward+backward+step")
    ratio("verify/ours wall", slowest("verify", "wall"), slowest("ours", "wall"), "share of our load spent verifying",
          per_repeat("verify", "ours"))
    ratio("checksum/ours wall", slowest("checksum", "wall"), slowest("ours", "wall"),
          "share of our load spent on the manifest check of the module file", per_repeat("checksum", "ours"))
    ratio("checksum/baseline wall", slowest("checksum", "wall"), slowest("baseline", "wall"),
          "manifest check against DeepSpeed's whole module-only load", per_repeat("checksum", "baseline"))
    if "resplit" in names:
        ratio("resplit/ours wall", slowest("resplit", "wall"), slowest("ours", "wall"),
              f"module-only load of a tensor-parallel size {options.saved_tp} checkpoint at size {options.tp}, "
              f"against one saved at {options.tp}", per_repeat("resplit", "ours"))
        ratio("resplit/ours node_private", node("resplit", "peak_private"), node("ours", "peak_private"),
              "node's peak private memory of that load against the same-size load")
    if "read_evicted" in names:
        ratio("read_evicted/read_cached wall", slowest("read_evicted", "wall"), slowest("read_cached", "wall"),
              "a plain read of the module file after the eviction against one from the page cache: above 1, it was cold",
              per_repeat("read_evicted", "read_cached"))
    if "raw" in names:
        ours_raw = per_repeat("ours", "raw")
        low, high = middle_half(ours_raw)
        ratio("ours/raw wall", slowest("ours", "wall"), slowest("raw", "wall"),
              f"against torch.load(mmap) + load_state_dict, which leaves the master stale; per repeat, middle half "
              f"{low:.2f}-{high:.2f}", ours_raw)
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, ranks=1, layers=4, hidden=512, heads=8, vocab=16384, seq=32, precision="bf16",
                          precisions=("fp32", "bf16", "fp16"), zero_stage=1, repeats=5)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the loading engine")
    parser.add_argument("--saved-tp", type=int,
                        help="tensor-parallel size of an engine that saves a second checkpoint, loaded as 'resplit' "
                             "(default: --tp, no resplit load)")
    parser.add_argument("--batch", type=int, default=1, help="micro batch of the training step")
    parser.add_argument("--cold", action="store_true",
                        help="evict the checkpoint's files from the page cache before every load (a first read)")
    options = parser.parse_args(argv)
    options.saved_tp = options.saved_tp or options.tp
    for name, size in (("--tp", options.tp), ("--saved-tp", options.saved_tp)):
        if size < 1 or options.ranks % size:
            parser.error(f"{name} {size} must divide --ranks {options.ranks}")
    malloc_returns_memory = world.measuring_process(options.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_module_only_") as scratch:
        port = world.free_port()
        if options.ranks == 1:
            rank_main(0, options, port, scratch)
        else:
            torch.multiprocessing.spawn(spawned_rank, args=(options, port, scratch), nprocs=options.ranks)
        ranks = [json.loads((Path(scratch) / f"rank{r}.json").read_text()) for r in range(options.ranks)]
    load_average = (load_before, os.getloadavg()[0])
    write_json(options, __doc__, report(options, ranks, load_average, malloc_returns_memory), load_average,
               ranks=ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
