"""Training throughput of 2 pipeline stages against one module on the same 2 ranks (data parallel).

    python tools/bench/bench_pipeline.py [--layers 8] [--hidden 256] [--heads 4] [--vocab 4096] [--seq 128]
        [--micro 4] [--micro-batches 4] [--repeats 3] [--steps 3] [--threads 1]

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

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_world import free_port, init_world, leaves_the_world  # noqa: E402
from deepspeed.utils import logger as deepspeed_logger  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron.data import BatchOptions  # noqa: E402
from megatron.initialize import ModelParallelUnit  # noqa: E402
from megatron.model import build_model  # noqa: E402
from megatron.model.pipeline import build_pipeline_model  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.objectives.language_model import forward_loss  # noqa: E402
from megatron.pipeline import pipeline_batches  # noqa: E402

STAGES = 2


def model_args(options: argparse.Namespace) -> NeoXArgs:
    return NeoXArgs.from_dict({
        "num_layers": options.layers, "hidden_size": options.hidden, "num_attention_heads": options.heads,
        "seq_length": options.seq, "max_position_embeddings": options.seq, "padded_vocab_size": options.vocab,
        "pos_emb": "rotary", "rotary_pct": 0.25, "gpt_j_residual": True, "no_weight_tying": True,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "pipe_parallel_size": STAGES, "num_gpus": STAGES})


def samples(options: argparse.Namespace, count: int):
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(count):
        yield {"text": torch.randint(0, options.vocab, (options.micro, options.seq + 1), generator=generator)}


def config(options: argparse.Namespace, micro_batches: int) -> dict:
    return {"train_micro_batch_size_per_gpu": options.micro, "gradient_accumulation_steps": micro_batches,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1},
            "steps_per_print": 10**9, "gradient_clipping": 1.0}


def set_groups(pipe: int) -> None:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, pipe)


def one_module_step(options, args):
    set_groups(1)
    model = build_model(args.architecture(), args.seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(options, options.micro_batches), mpu=ModelParallelUnit())

    def step():
        for micro_batch in samples(options, options.micro_batches):
            engine.backward(forward_loss(engine, micro_batch))
            engine.step()
    return step


def two_stages_step(options, args):
    set_groups(STAGES)
    module = build_pipeline_model(args.architecture(), args.seed, STAGES, "type:transformer|mlp")
    micro_batches = options.micro_batches * STAGES  # one replica instead of 2: the same tokens per step
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                      config=config(options, micro_batches))

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


@leaves_the_world
def rank_main(rank: int, options: argparse.Namespace, port: int, scratch: str) -> None:
    torch.set_num_threads(options.threads)
    deepspeed_logger.setLevel("WARNING")
    init_world(rank, STAGES, port)
    args = model_args(options)
    steps = {"one_module": one_module_step(options, args), "two_stages": two_stages_step(options, args)}
    for step in steps.values():
        step()  # warm-up
    seconds = {name: [] for name in steps}
    for repeat in range(options.repeats):
        for name in (list(steps) if repeat % 2 == 0 else list(steps)[::-1]):
            seconds[name].append(timed(steps[name], options.steps))
    (Path(scratch) / f"rank{rank}.json").write_text(json.dumps(seconds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4, help="micro batch size")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="micro batches per step of each of the 2 data-parallel ranks of one_module")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps timed per repeat")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    options = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as scratch:
        torch.multiprocessing.spawn(rank_main, args=(options, free_port(), scratch), nprocs=STAGES)
        ranks = [json.loads((Path(scratch) / f"rank{r}.json").read_text()) for r in range(STAGES)]
    tokens = STAGES * options.micro_batches * options.micro * options.seq  # per optimizer step, both sides
    print(f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; {tokens} tokens per step, "
          f"{options.repeats} repeats x {options.steps} steps")
    medians = {}
    for name in ranks[0]:
        per_repeat = [max(rank[name][i] for rank in ranks) for i in range(options.repeats)]  # the slowest rank
        medians[name] = statistics.median(per_repeat)
        print(f"{name:>10}: {1000 * medians[name]:8.1f} ms per step (spread {1000 * min(per_repeat):.1f}-"
              f"{1000 * max(per_repeat):.1f}), {tokens / medians[name]:8.0f} tokens/s")
    slots = options.micro_batches * STAGES
    print(f"RATIO two_stages/one_module tokens_per_second = {medians['one_module'] / medians['two_stages']:.3f}  "
          "(2 pipeline stages against 2 data-parallel ranks, the same tokens per step)")
    print(f"RATIO bubble = {(STAGES - 1) / (slots + STAGES - 1):.3f}  (the 1F1B schedule's idle fraction of each "
          f"stage for {slots} micro batches and {STAGES} stages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
