"""A mixture-of-experts step against a dense step with the same active parameters, and an MoE step's memory per
rank with its experts split over 2 ranks against 1: ratios in one run.

    python tools/bench/bench_moe_step.py [--layers 4] [--hidden 512] [--heads 8] [--seq 256] [--vocab 8192]
        [--precision bf16|fp32] [--zero-stage 1] [--experts 8] [--top-k 2] [--expert-width 512]
        [--micro-batch 2] [--steps 4] [--repeats 3] [--threads N] [--json PATH]

Each measurement is a fresh process (or two: the split variant), the variants taking turns every repeat. A
process builds a Llama-family GPTModel in a DeepSpeed engine with Adam, takes one warm-up step and times
`--steps` optimizer steps (forward, loss, backward, step) on the same batch:

| row      | the model                                                                                   |
| `dense`  | every layer's MLP `top_k x expert_width` wide per projection: the parameters a token meets   |
|          | in the MoE model                                                                            |
| `moe`    | `--experts` experts `--expert-width` wide in every layer, top-k routing (`topk` router), 1 rank |
| `moe-tp2`| the same model with its experts (and attention) split over 2 tensor-parallel ranks, as GPT-NeoX |
|          | splits them; step time and memory of the slowest / largest rank                              |

Memory: each process's peak RSS (VmHWM) above its RSS before the model was built, so weights, gradients, fp32
masters and optimizer state all count. Ratios: `moe/dense step_seconds` (the price of routing and of running the
experts grouped by expert), `moe/dense peak_rss` (the experts' extra weights and optimizer state), and
`moe-tp2/moe peak_rss per rank` (what splitting the experts saves each rank).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Ratios, bench_parser, repeat_ratios, step_table, variants_in_fresh_processes, write_json  # noqa: E402

VARIANTS = ("dense", "moe", "moe-tp2")
TENSOR_PARALLEL = {"dense": 1, "moe": 1, "moe-tp2": 2}


def model_settings(options: argparse.Namespace, variant: str) -> dict:
    """GPT-NeoX settings of ``variant``'s model. The dense MLP's ``intermediate_size`` is GPT-NeoX's ungated width:
    swiglu builds two thirds of it per projection, so 3 x top_k x expert_width builds top_k x expert_width."""
    import bench_world as world

    if variant == "dense":
        mlp = {"intermediate_size": 3 * options.top_k * options.expert_width}
    else:
        mlp = {"moe_num_experts": options.experts, "moe_top_k": options.top_k, "moe_router_type": "topk",
               "moe_intermediate_size": options.expert_width, "moe_norm_topk_prob": True}
    tensor_parallel = TENSOR_PARALLEL[variant]
    return world.model_settings(options, **world.LLAMA, mlp_multiple_of=32, model_parallel_size=tensor_parallel,
                                num_gpus=tensor_parallel, train_micro_batch_size_per_gpu=options.micro_batch,
                                train_iters=10, **mlp)


def measure_rank(rank: int, options: argparse.Namespace, port: int, scratch: str) -> None:
    """On one rank of ``options.variant``: build its engine, time its steps, write its record to ``scratch``."""
    import bench_world as world
    import torch
    from megatron.core import parallel_state
    from procmem import status_kib

    from megatron.model import build_model
    from megatron.neox_arguments import NeoXArgs

    world.measuring_process(options.threads)
    tensor_parallel = TENSOR_PARALLEL[options.variant]
    world.init_world(rank, tensor_parallel, port)
    if tensor_parallel > 1:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_parallel, 1)
    args = NeoXArgs.from_dict(model_settings(options, options.variant))
    arch = args.architecture()
    before_kib = status_kib("VmRSS")
    model = build_model(arch, args.seed)
    engine = world.build_engine(model, world.deepspeed_config(options.micro_batch, options.zero_stage,
                                                              options.precision))
    tokens = torch.randint(0, options.vocab, (options.micro_batch, options.seq + 1),
                           generator=torch.Generator().manual_seed(0))
    world.train_step(engine, tokens)  # warm-up: kernels, optimizer state
    seconds = []
    for _ in range(options.steps):
        started = time.perf_counter()
        world.train_step(engine, tokens)
        seconds.append(time.perf_counter() - started)
    mlp_width = arch.intermediate_size if options.variant == "dense" else options.top_k * arch.moe_intermediate_size
    record = {"step_seconds": median(seconds), "peak_mib": (status_kib("VmHWM") - before_kib) / 1024,
              "parameters_on_rank": sum(p.numel() for p in model.parameters()), "active_mlp_width": mlp_width}
    Path(scratch, f"rank{rank}.json").write_text(json.dumps(record))
    world.leave_process_group()


def measure_variant(options: argparse.Namespace) -> dict:
    """In this process (and, split, one more): ``options.variant``'s slowest rank's step, largest rank's peak."""
    # not bench_world's free_port: DeepSpeed's import is a split variant's ranks' to pay, not this process's
    import torch

    from megatron.launch.launcher import free_port

    ranks = TENSOR_PARALLEL[options.variant]
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as scratch:
        port = free_port()
        if ranks == 1:
            measure_rank(0, options, port, scratch)
        else:
            torch.multiprocessing.spawn(measure_rank, args=(options, port, scratch), nprocs=ranks)
        records = [json.loads(Path(scratch, f"rank{rank}.json").read_text()) for rank in range(ranks)]
    return {"step_seconds": max(r["step_seconds"] for r in records), "peak_mib": max(r["peak_mib"] for r in records),
            "parameters_on_rank": max(r["parameters_on_rank"] for r in records),
            "active_mlp_width": records[0]["active_mlp_width"]}


def _shared_flags(options: argparse.Namespace) -> list[str]:
    return [flag for name in ("layers", "hidden", "heads", "seq", "vocab", "precision", "zero_stage", "experts",
                              "top_k", "expert_width", "micro_batch", "steps", "threads")
            for flag in (f"--{name.replace('_', '-')}", str(getattr(options, name)))]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=4, hidden=512, heads=8, vocab=8192, seq=256, precision="bf16",
                          zero_stage=1, zero_stages=(0, 1, 2), repeats=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=512, help="each expert's width per projection")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process (their median is its time)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one measuring process
    options = parser.parse_args(argv)
    if options.variant:
        print(json.dumps(measure_variant(options)))
        return 0

    results, load_average = variants_in_fresh_processes(__file__, VARIANTS, options.repeats,
                                                         _shared_flags(options))
    dense, moe, split = (results[variant][0] for variant in VARIANTS)
    if dense["active_mlp_width"] != moe["active_mlp_width"]:
        raise SystemExit(f"bench_moe_step.py: the dense MLP is {dense['active_mlp_width']} wide, a token's experts "
                         f"{moe['active_mlp_width']}; choose --expert-width a multiple of 32")
    times = {variant: [r["step_seconds"] for r in runs] for variant, runs in results.items()}
    peaks = {variant: [r["peak_mib"] for r in runs] for variant, runs in results.items()}
    print(f"shapes: Llama family ({options.layers} layers, hidden {options.hidden}, vocab {options.vocab}), "
          f"{options.precision}, ZeRO stage {options.zero_stage}, Adam; micro batch {options.micro_batch} x "
          f"{options.seq} tokens; {options.experts} experts {options.expert_width} wide, top {options.top_k} "
          f"(a token meets {moe['active_mlp_width']} MLP columns, as in the dense model); parameters: dense "
          f"{dense['parameters_on_rank'] / 1e6:.1f}M, moe {moe['parameters_on_rank'] / 1e6:.1f}M, moe-tp2 "
          f"{split['parameters_on_rank'] / 1e6:.1f}M per rank; repeats {options.repeats}; load average "
          f"{load_average[1]:.2f}")
    print(step_table(times, peaks, VARIANTS))
    report = Ratios()
    report.add("moe/dense step_seconds", median(times["moe"]), median(times["dense"]),
               "an MoE step against a dense step with the same active parameters",
               repeat_ratios(times["moe"], times["dense"]))
    report.add("moe/dense peak_rss", median(peaks["moe"]), median(peaks["dense"]),
               "peak memory of the MoE run against the dense run", repeat_ratios(peaks["moe"], peaks["dense"]))
    report.add("moe-tp2/moe peak_rss per rank", median(peaks["moe-tp2"]), median(peaks["moe"]),
               "the largest rank's peak memory with the experts split over 2 ranks against 1 rank holding all",
               repeat_ratios(peaks["moe-tp2"], peaks["moe"]))
    write_json(options, __doc__, report, load_average, step_seconds=times, peak_mib=peaks,
               parameters={variant: results[variant][0]["parameters_on_rank"] for variant in VARIANTS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
