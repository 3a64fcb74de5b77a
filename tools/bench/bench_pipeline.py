"""Training throughput of 2 pipeline stages against one module on the same 2 ranks (data parallel).

    python tools/bench/bench_pipeline.py [--layers 8] [--hidden 256] [--heads 4] [--vocab 4096] [--seq 128]
        [--micro 4] [--micro-batches 4] [--repeats 3] [--steps 3] [--threads 1] [--json PATH]

Both sides train the same model (GPT-NeoX/Pythia family, fp32, ZeRO-1, AdamW) on the same number of
tokens per optimizer step, in a gloo world of 2 processes on this machine:

| row | engine | per rank and step |
|---|---|---|
| `one_module` | `build_model` in DeepSpeed's engine, 2 data-parallel ranks | `--micro-batches` micro batches of `--micro` |
| `two_stages` | `build_pipeline_model` in DeepSpeed's pipe engine (`train_batch`), 1 data-parallel replica | 2 x `--micro-batches` micro batches of `--micro`, each through both stages |

Each repeat times `--steps` optimizer steps of each (after one untimed warm-up step of each), the order
alternating. Ratio `two_stages/one_module tokens_per_second`: what the pipeline costs where the whole
model fits on each rank. The pipe engine's schedule (1F1B) leaves each stage idle for (stages - 1)
of the (micro batches + stages - 1) slots of a step: `bubble` prints that fraction for these sizes.
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

import bench_world as world  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness import Ratios, bench_parser, in_turn, repeat_ratios, slowest_rank, write_json  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron.data import BatchOptions  # noqa: E402
from megatron.model import build_model  # noqa: E402
from megatron.model.pipeline import build_pipeline_model  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.objectives.language_model import forward_loss  # noqa: E402
from megatron.training.pipe_engine import pipeline_batches  # noqa: E402

STAGES = 2


def model_args(options: argparse.Namespace) -> NeoXArgs:
    return NeoXArgs.from_dict(world.model_settings(options, **world.PYTHIA, pipe_parallel_size=STAGES,
                                                   num_gpus=STAGES))


def samples(options: argparse.Namespace, count: int):
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(count):
        yield {"text": torch.randint(0, options.vocab, (options.micro, options.seq + 1), generator=generator)}


def config(options: argparse.Namespace, micro_batches: int) -> dict:
    return world.deepspeed_config(options.micro, 1, "fp32", optimizer="AdamW",
                                  gradient_accumulation_steps=micro_batches, gradient_clipping=1.0)


def set_groups(pipe: int) -> None:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, pipe)


def one_module_step(options, args):
    set_groups(1)
    model = build_model(args.architecture(), args.seed)
    engine = world.build_engine(model, config(options, options.micro_batches))

    def step():
        for micro_batch in samples(options, options.micro_batches):
            engine.backward(forward_loss(engine, micro_batch))
            engine.step()
    return step


def two_stages_step(options, args):
    set_groups(STAGES)
    module = build_pipeline_model(args.architecture(), args.seed, STAGES, "type:transformer|mlp")
    micro_batches = options.micro_batches * STAGES  # one replica instead of 2: the same tokens per step
    engine = world.build_engine(module, config(options, micro_batches), mpu=False)

    def step():
        engine.train_batch(pipeline_batches(samples(options, micro_batches), BatchOptions()))
    return step


def timed(step, steps: int) -> float:
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - started) / steps


@world.leaves_the_world
def rank_main(rank: int, options: argparse.Namespace, port: int, scratch: str) -> None:
    world.measuring_process(options.threads, return_freed_memory=False)
    world.init_world(rank, STAGES, port)
    args = model_args(options)
    steps = {"one_module": one_module_step(options, args), "two_stages": two_stages_step(options, args)}
    for step in steps.values():
        step()  # warm-up
    seconds = {name: [] for name in steps}
    for repeat in range(options.repeats):
        for name in in_turn(list(steps), repeat):
            seconds[name].append(timed(steps[name], options.steps))
    (Path(scratch) / f"rank{rank}.json").write_text(json.dumps(seconds))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=8, hidden=256, heads=4, vocab=4096, seq=128, repeats=3, threads=1)
    parser.add_argument("--micro", type=int, default=4, help="micro batch size")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="micro batches per step of each of the 2 data-parallel ranks of one_module")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps timed per repeat")
    options = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as scratch:
        torch.multiprocessing.spawn(rank_main, args=(options, world.free_port(), scratch), nprocs=STAGES)
        ranks = [json.loads((Path(scratch) / f"rank{r}.json").read_text()) for r in range(STAGES)]
    tokens = STAGES * options.micro_batches * options.micro * options.seq  # per optimizer step, both sides
    load_average = (load_before, os.getloadavg()[0])
    print(f"load average {load_average[0]:.1f} -> {load_average[1]:.1f}; {tokens} tokens per step, "
          f"{options.repeats} repeats x {options.steps} steps")
    medians, per_repeat = {}, {}
    for name in ranks[0]:
        per_repeat[name] = slowest_rank([rank[name] for rank in ranks])
        medians[name] = statistics.median(per_repeat[name])
        print(f"{name:>10}: {1000 * medians[name]:8.1f} ms per step (spread {1000 * min(per_repeat[name]):.1f}-"
              f"{1000 * max(per_repeat[name]):.1f}), {tokens / medians[name]:8.0f} tokens/s")
    slots = options.micro_batches * STAGES
    ratios = Ratios()
    ratios.add("two_stages/one_module tokens_per_second", medians["one_module"], medians["two_stages"],
               "2 pipeline stages against 2 data-parallel ranks, the same tokens per step",
               repeat_ratios(per_repeat["one_module"], per_repeat["two_stages"]))
    ratios.add("bubble", STAGES - 1, slots + STAGES - 1,
               f"the 1F1B schedule's idle fraction of each stage for {slots} micro batches and {STAGES} stages")
    write_json(options, __doc__, ratios, load_average, seconds_per_step=per_repeat, tokens_per_step=tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
