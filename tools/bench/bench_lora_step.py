"""A LoRA fine-tune step against a full fine-tune step of the same model: step time and memory, ratios in one run.

    python tools/bench/bench_lora_step.py [--layers 4] [--hidden 512] [--heads 8] [--seq 256] [--vocab 8192]
        [--precision bf16|fp32] [--zero-stage 1] [--lora-rank 16] [--micro-batch 2] [--steps 4] [--repeats 3]
        [--larger 8x1024] [--threads N] [--json PATH]

Each measurement is a fresh process (so one variant's freed memory cannot hide the other's), the two variants
alternating every repeat. A process builds a Llama-family GPTModel in a DeepSpeed engine with Adam, takes one
warm-up step and times `--steps` optimizer steps (forward, loss, backward, step) on the same batch:

| row    | the model                                                                                  |
| `full` | every weight trains                                                                        |
| `lora` | `lora_rank` adapters on every linear layer (`all-linear`, alpha = 2 x rank), the base frozen |

Memory: the process's peak RSS (VmHWM) above its RSS before the model was built, so weights, gradients, fp32
masters and optimizer state all count. For scale the output also gives the base's weights at the run's
precision and the adapters' share of the parameters. Ratios: `lora/full step_seconds`, `lora/full peak_rss`.

`--larger LAYERSxHIDDEN` measures both variants again at a second, larger model (heads keeping their width),
so the trend of the memory ratio with the model's size shows: `lora/full peak_rss at LAYERSxHIDDEN`
(`--larger none`: only the first size).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Ratios, bench_parser, repeat_ratios, step_table, variants_in_fresh_processes, write_json  # noqa: E402

VARIANTS = ("full", "lora")


def measure_variant(options: argparse.Namespace) -> dict:
    """In this process: build `options.variant`'s engine, time its steps, read its peak memory."""
    import bench_world as world
    import torch
    from procmem import status_kib

    from megatron.model import build_model
    from megatron.neox_arguments import NeoXArgs
    from megatron.optim.optimizers import build_param_groups

    world.measuring_process(options.threads)
    world.init_world()
    lora = {"lora_rank": options.lora_rank, "lora_alpha": 2 * options.lora_rank, "lora_target_modules": "all-linear"}
    args = NeoXArgs.from_dict(world.model_settings(
        options, **world.LLAMA, num_kv_heads=max(options.heads // 2, 1), mlp_multiple_of=32,
        train_micro_batch_size_per_gpu=options.micro_batch, train_iters=10,
        **(lora if options.variant == "lora" else {})))
    before_kib = status_kib("VmRSS")
    model = build_model(args.architecture(), args.seed, lora=args.lora())
    config = world.deepspeed_config(options.micro_batch, options.zero_stage, options.precision)
    engine = world.build_engine(model, config, model_parameters=build_param_groups(model, 0.0))
    tokens = torch.randint(0, options.vocab, (options.micro_batch, options.seq + 1),
                           generator=torch.Generator().manual_seed(0))
    world.train_step(engine, tokens)  # warm-up: kernels, optimizer state
    seconds = []
    for _ in range(options.steps):
        started = time.perf_counter()
        world.train_step(engine, tokens)
        seconds.append(time.perf_counter() - started)
    parameters = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"step_seconds": median(seconds), "peak_mib": (status_kib("VmHWM") - before_kib) / 1024,
            "parameters": parameters, "trained": trained,
            "base_mib": (parameters - trained if options.variant == "lora" else parameters)
            * (2 if options.precision == "bf16" else 4) / 2**20}


def _shared_flags(options: argparse.Namespace, layers: int, hidden: int, heads: int) -> list[str]:
    return ["--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads),
            "--seq", str(options.seq), "--vocab", str(options.vocab), "--precision", options.precision,
            "--zero-stage", str(options.zero_stage), "--lora-rank", str(options.lora_rank),
            "--micro-batch", str(options.micro_batch), "--steps", str(options.steps), "--threads", str(options.threads)]


def _larger_size(text: str) -> tuple[int, int] | None:
    if text == "none":
        return None
    layers, _, hidden = text.partition("x")
    if not (layers.isdigit() and hidden.isdigit()):
        raise argparse.ArgumentTypeError(f"--larger takes LAYERSxHIDDEN (such as 8x1024) or none, not {text!r}")
    return int(layers), int(hidden)


def _measure_size(options: argparse.Namespace, layers: int, hidden: int, heads: int) -> tuple[dict, tuple]:
    """Both variants at one model size: their records (full and lora each as a list over repeats), the load."""
    results, load_average = variants_in_fresh_processes(__file__, VARIANTS, options.repeats,
                                                         _shared_flags(options, layers, hidden, heads))
    full, lora = results["full"][0], results["lora"][0]
    print(f"shapes: Llama family, {full['parameters'] / 1e6:.1f}M parameters ({layers} layers, hidden "
          f"{hidden}, vocab {options.vocab}), {options.precision}, ZeRO stage {options.zero_stage}, Adam; "
          f"micro batch {options.micro_batch} x {options.seq} tokens; LoRA rank {options.lora_rank} on all-linear: "
          f"{lora['trained']:,} trained parameters ({100 * lora['trained'] / lora['parameters']:.2f}%); base weights "
          f"at {options.precision}: {lora['base_mib']:.1f} MiB; repeats {options.repeats}; load average "
          f"{load_average[1]:.2f}")
    return results, load_average


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=4, hidden=512, heads=8, vocab=8192, seq=256, precision="bf16",
                          zero_stage=1, zero_stages=(0, 1, 2), repeats=3)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process (their median is its time)")
    parser.add_argument("--larger", type=_larger_size, default="8x1024",
                        help="a second model size, LAYERSxHIDDEN, for the memory ratio's trend (none: skip it)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one measuring process
    options = parser.parse_args(argv)
    if options.variant:
        print(json.dumps(measure_variant(options)))
        return 0

    first, load_average = _measure_size(options, options.layers, options.hidden, options.heads)
    times = {variant: [r["step_seconds"] for r in runs] for variant, runs in first.items()}
    peaks = {variant: [r["peak_mib"] for r in runs] for variant, runs in first.items()}
    print(step_table(times, peaks, VARIANTS))
    report = Ratios()
    report.add("lora/full step_seconds", median(times["lora"]), median(times["full"]),
               "a LoRA step against a full fine-tune step of the same model", repeat_ratios(times["lora"],
                                                                                          times["full"]))
    report.add("lora/full peak_rss", median(peaks["lora"]), median(peaks["full"]),
               "peak memory of the LoRA run against the full fine-tune", repeat_ratios(peaks["lora"], peaks["full"]))
    larger = {}
    if options.larger:
        layers, hidden = options.larger
        heads = max(hidden // (options.hidden // options.heads), 1)
        results, load_average = _measure_size(options, layers, hidden, heads)
        larger = {variant: [r["peak_mib"] for r in runs] for variant, runs in results.items()}
        print(step_table({v: [r["step_seconds"] for r in runs] for v, runs in results.items()}, larger, VARIANTS))
        report.add(f"lora/full peak_rss at {layers}x{hidden}", median(larger["lora"]), median(larger["full"]),
                   f"the same at {results['full'][0]['parameters'] / 1e6:.0f}M parameters",
                   repeat_ratios(larger["lora"], larger["full"]))
    write_json(options, __doc__, report, load_average, step_seconds=times, peak_mib=peaks,
               base_mib=first["lora"][0]["base_mib"], trained_parameters=first["lora"][0]["trained"],
               parameters=first["lora"][0]["parameters"], larger_peak_mib=larger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
