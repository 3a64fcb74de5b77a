"""Tensor parallelism with sequence parallelism against without it, on 2 ranks: peak memory of a step and tokens/s.

    python tools/bench/bench_sequence_parallel.py [--layers 2] [--hidden 128] [--heads 4] [--vocab 1024]
        [--seqs 2048 4096 8192] [--micro 1] [--steps 2] [--repeats 2] [--threads 1] [--json PATH]

Both rows train the same Llama-family model (fp32, ZeRO-1, Adam) at model_parallel_size 2 in a gloo world of 2
processes on this machine, one micro batch of `--micro` x seq tokens per step:

| row     | settings                                                                   |
| `tp2`   | model_parallel_size 2                                                      |
| `tp2_sp`| model_parallel_size 2, sequence_parallel: true (the residual stream split)  |

Each measurement is a fresh world of 2 processes (so one row's freed memory cannot hide the other's), the rows
alternating every repeat. A rank takes one untimed warm-up step (the optimizer state exists afterwards), then
one step whose peak RSS above the RSS before it is the step's memory (activations and gradients: weights and
optimizer state are there before), then `--steps` timed steps. Per rank the larger of the two ranks' peaks and
the slower rank's time count. Ratios per sequence length: `tp2_sp/tp2 peak_rss@<seq>` and
`tp2_sp/tp2 tokens_per_second@<seq>`. On CPU the collectives are gloo's (sequence parallelism's reduce-scatter is
an all-reduce there, megatron/model/sequence_parallel.py), so the time ratio says little about NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from harness import Ratios, bench_parser, in_turn, repeat_ratios, table, write_json  # noqa: E402

ROWS = ("tp2", "tp2_sp")
RANKS = 2


def rank_main(rank: int, options: argparse.Namespace, row: str, seq: int, port: int, scratch: str) -> None:
    import bench_world as world
    import torch.distributed as dist
    from megatron.core import parallel_state
    from procmem import measure_memory

    from megatron.model import build_model
    from megatron.neox_arguments import NeoXArgs
    from megatron.runtime.initialize import leave_process_group

    world.measuring_process(options.threads)
    world.init_world(rank, RANKS, port)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(RANKS, 1)
    options.seq = seq
    args = NeoXArgs.from_dict(world.model_settings(
        options, **world.LLAMA, num_kv_heads=options.heads, mlp_multiple_of=32, model_parallel_size=RANKS,
        num_gpus=RANKS, sequence_parallel=row == "tp2_sp", train_micro_batch_size_per_gpu=options.micro))
    engine = world.build_engine(build_model(args.architecture(), args.seed),
                                world.deepspeed_config(options.micro, 1, "fp32"))
    tokens = torch.randint(0, options.vocab, (options.micro, seq + 1), generator=torch.Generator().manual_seed(0))
    world.train_step(engine, tokens)  # warm-up: kernels and the optimizer state
    _, memory = measure_memory(lambda: world.train_step(engine, tokens))
    dist.barrier()
    started = time.perf_counter()
    for _ in range(options.steps):
        world.train_step(engine, tokens)
    seconds = (time.perf_counter() - started) / options.steps
    (Path(scratch) / f"rank{rank}.json").write_text(json.dumps({"peak_mib": memory.peak_growth_mib,
                                                                "seconds": seconds}))
    leave_process_group()


def measure(options: argparse.Namespace, row: str, seq: int) -> dict:
    """One fresh world of 2 ranks: the larger peak and the slower step of the two."""
    from megatron.launch.launcher import free_port  # not bench_world: DeepSpeed's import is the ranks' to pay

    with tempfile.TemporaryDirectory(prefix="bench_sequence_parallel_") as scratch:
        torch.multiprocessing.spawn(rank_main, args=(options, row, seq, free_port(), scratch), nprocs=RANKS)
        ranks = [json.loads((Path(scratch) / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return {"peak_mib": max(r["peak_mib"] for r in ranks), "seconds": max(r["seconds"] for r in ranks)}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=2, hidden=128, heads=4, vocab=1024, repeats=2, threads=1)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192], help="sequence lengths")
    parser.add_argument("--micro", type=int, default=1, help="micro batch size")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per measurement")
    options = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    peaks = {f"{row}@{seq}": [] for row in ROWS for seq in options.seqs}
    seconds = {name: [] for name in peaks}
    for repeat in range(options.repeats):
        for seq in options.seqs:
            for row in in_turn(ROWS, repeat):
                record = measure(options, row, seq)
                peaks[f"{row}@{seq}"].append(record["peak_mib"])
                seconds[f"{row}@{seq}"].append(record["seconds"])
    load_average = (load_before, os.getloadavg()[0])
    tokens_per_second = {name: [options.micro * int(name.split("@")[1]) / s for s in values]
                         for name, values in seconds.items()}
    print(f"Llama family, {options.layers} layers, hidden {options.hidden}, fp32, ZeRO-1, 2 ranks at "
          f"model_parallel_size 2; micro batch {options.micro}; repeats {options.repeats}; load average "
          f"{load_average[0]:.1f} -> {load_average[1]:.1f}")
    print(table(["row@seq", "peak step RSS per rank (MiB)", "tokens/s"],
                [[name, statistics.median(peaks[name]), statistics.median(tokens_per_second[name])]
                 for name in peaks]))
    report = Ratios()
    for seq in options.seqs:
        sp, tp = f"tp2_sp@{seq}", f"tp2@{seq}"
        report.add(f"tp2_sp/tp2 peak_rss@{seq}", statistics.median(peaks[sp]), statistics.median(peaks[tp]),
                   f"a step's peak memory per rank with sequence parallelism against without, {seq} tokens",
                   repeat_ratios(peaks[sp], peaks[tp]))
        report.add(f"tp2_sp/tp2 tokens_per_second@{seq}", statistics.median(tokens_per_second[sp]),
                   statistics.median(tokens_per_second[tp]),
                   f"throughput with sequence parallelism against without (gloo), {seq} tokens",
                   repeat_ratios(tokens_per_second[sp], tokens_per_second[tp]))
    write_json(options, __doc__, report, load_average, peak_mib=peaks, tokens_per_second=tokens_per_second)
    return 0


if __name__ == "__main__":
    sys.exit(main())
