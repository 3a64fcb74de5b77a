"""Long sequences: tensor parallelism with sequence parallelism against without it, and context parallelism against
one rank holding the whole sequence: peak memory of a step per rank and tokens/s.

    python tools/bench/bench_sequence_parallel.py [--layers 2] [--hidden 128] [--heads 4] [--vocab 1024]
        [--seqs 2048 4096 8192] [--micro 1] [--steps 2] [--repeats 2] [--threads 1] [--json PATH]

Every row trains the same Llama-family model (fp32, ZeRO-1, Adam) in a gloo world of processes on this machine,
one micro batch of `--micro` x seq tokens per step:

| row      | world and settings                                                              |
| `tp2`    | 2 ranks, model_parallel_size 2                                                  |
| `tp2_sp` | 2 ranks, model_parallel_size 2, sequence_parallel: true (the residual stream split) |
| `one`    | 1 rank holding the whole sequence (context_parallel_size 1)                      |
| `cp2`    | 2 ranks, context_parallel_size 2 (each holds half of every sequence)             |

Each measurement is a fresh world (so one row's freed memory cannot hide another's), the rows alternating every
repeat. A rank takes one untimed warm-up step (the optimizer state exists afterwards), then one step whose peak
RSS above the RSS before it is the step's memory (activations and gradients: weights and optimizer state are
there before), then `--steps` timed steps. Per rank the larger of the ranks' peaks and the slowest rank's time
count. Ratios per sequence length: `tp2_sp/tp2 peak_rss@<seq>`, `tp2_sp/tp2 tokens_per_second@<seq>`,
`cp2/one peak_rss@<seq>` and `cp2/one tokens_per_second@<seq>`. On CPU the collectives are gloo's (sequence
parallelism's reduce-scatter is an all-reduce there, megatron/model/sequence_parallel.py, and so is the
reduce-scatter of context parallelism's key and value gradients), so the time ratios say little about NCCL.
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

ROWS = ("tp2", "tp2_sp", "one", "cp2")
RANKS = {"tp2": 2, "tp2_sp": 2, "one": 1, "cp2": 2}
TENSOR_PARALLEL = {"tp2": 2, "tp2_sp": 2, "one": 1, "cp2": 1}
CONTEXT_PARALLEL = {"tp2": 1, "tp2_sp": 1, "one": 1, "cp2": 2}


def rank_main(rank: int, options: argparse.Namespace, row: str, seq: int, port: int, scratch: str) -> None:
    import bench_world as world
    import torch.distributed as dist
    from megatron.core import parallel_state
    from procmem import measure_memory

    from megatron.model import build_model
    from megatron.neox_arguments import NeoXArgs
    from megatron.runtime.initialize import leave_process_group

    world.measuring_process(options.threads)
    ranks, tensor_parallel, context_parallel = RANKS[row], TENSOR_PARALLEL[row], CONTEXT_PARALLEL[row]
    world.init_world(rank, ranks, port)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_parallel, 1, context_parallel_size=context_parallel)
    options.seq = seq
    args = NeoXArgs.from_dict(world.model_settings(
        options, **world.LLAMA, num_kv_heads=options.heads, mlp_multiple_of=32, model_parallel_size=tensor_parallel,
        context_parallel_size=context_parallel, num_gpus=ranks, sequence_parallel=row == "tp2_sp",
        train_micro_batch_size_per_gpu=options.micro))
    engine = world.build_engine(build_model(args.architecture(), args.seed),
                                world.deepspeed_config(options.micro, 1, "fp32"))
    tokens = torch.randint(0, options.vocab, (options.micro, seq + 1), generator=torch.Generator().manual_seed(0))
    split = context_parallel > 1
    world.train_step(engine, tokens, context_parallel=split)  # warm-up: kernels and the optimizer state
    _, memory = measure_memory(lambda: world.train_step(engine, tokens, context_parallel=split))
    dist.barrier()
    started = time.perf_counter()
    for _ in range(options.steps):
        world.train_step(engine, tokens, context_parallel=split)
    seconds = (time.perf_counter() - started) / options.steps
    (Path(scratch) / f"rank{rank}.json").write_text(json.dumps({"peak_mib": memory.peak_growth_mib,
                                                                "seconds": seconds}))
    leave_process_group()


def measure(options: argparse.Namespace, row: str, seq: int) -> dict:
    """One fresh world of the row's ranks: the largest peak and the slowest step of its ranks."""
    from megatron.launch.launcher import free_port  # not bench_world: DeepSpeed's import is the ranks' to pay

    with tempfile.TemporaryDirectory(prefix="bench_sequence_parallel_") as scratch:
        torch.multiprocessing.spawn(rank_main, args=(options, row, seq, free_port(), scratch), nprocs=RANKS[row])
        ranks = [json.loads((Path(scratch) / f"rank{r}.json").read_text()) for r in range(RANKS[row])]
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
    print(f"Llama family, {options.layers} layers, hidden {options.hidden}, fp32, ZeRO-1; "
          f"micro batch {options.micro}; repeats {options.repeats}; load average "
          f"{load_average[0]:.1f} -> {load_average[1]:.1f}")
    print(table(["row@seq", "peak step RSS per rank (MiB)", "tokens/s"],
                [[name, statistics.median(peaks[name]), statistics.median(tokens_per_second[name])]
                 for name in peaks]))
    report = Ratios()
    for seq in options.seqs:
        for row, baseline, meaning in (("tp2_sp", "tp2", "with sequence parallelism against without (TP 2)"),
                                       ("cp2", "one", "at context_parallel_size 2 against one rank")):
            split, whole = f"{row}@{seq}", f"{baseline}@{seq}"
            report.add(f"{row}/{baseline} peak_rss@{seq}", statistics.median(peaks[split]),
                       statistics.median(peaks[whole]), f"a step's peak memory per rank {meaning}, {seq} tokens",
                       repeat_ratios(peaks[split], peaks[whole]))
            report.add(f"{row}/{baseline} tokens_per_second@{seq}", statistics.median(tokens_per_second[split]),
                       statistics.median(tokens_per_second[whole]), f"throughput {meaning} (gloo), {seq} tokens",
                       repeat_ratios(tokens_per_second[split], tokens_per_second[whole]))
    write_json(options, __doc__, report, load_average, peak_mib=peaks, tokens_per_second=tokens_per_second)
    return 0


if __name__ == "__main__":
    sys.exit(main())
