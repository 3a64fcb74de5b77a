"""A DPO or KTO step against an SFT step on the same model: step time and memory, ratios in one run.

    python tools/bench/bench_dpo_step.py [--objective dpo|kto] [--layers 4] [--hidden 256] [--heads 4] [--seq 256]
        [--pairs 2] [--vocab 8192] [--precision fp32|bf16] [--zero-stage 1] [--repeats 5] [--threads N] [--json PATH]

One process builds a Llama-family GPTModel in a DeepSpeed engine with Adam (the policy) and times, the order
rotating each repeat, one optimizer step (forward, loss, backward, step) of (OBJ: `--objective`):

| row            | the step                                                                                   |
| `sft`          | train_impl normal on 2 x `--pairs` sequences (as many as a DPO micro batch of `--pairs` pairs holds) |
| `OBJ`          | train_impl dpo on `--pairs` pairs, or kto on 2 x `--pairs` sequences (half desirable), against a live frozen reference (megatron/objectives/) |
| `OBJ_precomputed` | the same objective reading precomputed reference log-probabilities (precompute_model_name) |

The reference is what training builds (the same model in a forward-only engine of the run's precision, no
parameter requiring grad). Memory: the process's peak RSS during a step (VmHWM, reset before it) above its RSS
before any model was built, so the reference's resident weights count for `OBJ`; `sft` and `OBJ_precomputed`
are measured before the reference exists. Ratios: `OBJ/sft step_seconds`, `OBJ_precomputed/sft step_seconds`,
`OBJ/sft peak_rss`, `OBJ_precomputed/OBJ peak_rss` (below 1: the memory precompute_model_name saves).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_world as world  # noqa: E402
import torch  # noqa: E402
from harness import Ratios, bench_parser, in_turn, repeat_ratios, step_table, write_json  # noqa: E402
from procmem import measure_memory, status_kib  # noqa: E402

from megatron.data import BatchOptions  # noqa: E402
from megatron.model import build_model  # noqa: E402
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.objectives.dpo import DirectPreferenceOptimization  # noqa: E402
from megatron.objectives.kto import KahnemanTverskyOptimization  # noqa: E402
from megatron.objectives.language_model import LanguageModelLoss  # noqa: E402
from megatron.training.loop import frozen_reference_engine  # noqa: E402


def llama_settings(options: argparse.Namespace, micro_batch: int, zero_stage: int) -> NeoXArgs:
    """A Llama-family model of the options' --layers, --hidden, --heads, --seq, --vocab and --precision, without
    dropout, trained with Adam (bench_reference_zero3.py builds the same)."""
    precision = {"bf16": {"precision": "bf16", "bf16": {"enabled": True}}}.get(options.precision, {})
    return NeoXArgs.from_dict(world.model_settings(
        options, **world.LLAMA, num_kv_heads=max(options.heads // 2, 1), mlp_multiple_of=32,
        train_micro_batch_size_per_gpu=micro_batch, optimizer={"type": "Adam", "params": {"lr": 1e-5}},
        zero_optimization={"stage": zero_stage}, train_iters=10, **precision))


def preference_objective(name: str, reference=None):
    """The objective `name` (beta 0.1, fp32 log-probabilities) against `reference`, or precomputed without one."""
    if name == "kto":
        return KahnemanTverskyOptimization(BatchOptions(), 0.1, True, 1.0, 1.0, reference)
    return DirectPreferenceOptimization(BatchOptions(), 0.1, True, reference)


def preference_samples(name: str, text, label, generator) -> tuple[dict, dict]:
    """(samples for the live reference, the same with precomputed reference log-probabilities) of `name`."""
    rows, seq = text.shape[0], text.shape[1] - 1
    if name == "kto":
        live = {"text": text, "label": label, "reward": torch.tensor([1.0, -1.0]).repeat(rows // 2)}
        return live, {**live, "ref": -torch.rand(rows, seq, generator=generator) * 5}
    pairs = rows // 2
    live = {"pos": text[:pairs], "neg": text[pairs:], "pos_label": label[:pairs], "neg_label": label[pairs:]}
    return live, {**live, "pos_ref": -torch.rand(pairs, seq, generator=generator) * 5,
                  "neg_ref": -torch.rand(pairs, seq, generator=generator) * 5}


def step(engine, objective, samples) -> float:
    started = time.perf_counter()
    loss, _ = objective(engine, samples)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - started


@world.leaves_the_world
def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=4, hidden=256, heads=4, vocab=8192, seq=256, precision="fp32",
                          zero_stage=1, zero_stages=(0, 1, 2), repeats=5)
    parser.add_argument("--objective", choices=("dpo", "kto"), default="dpo")
    parser.add_argument("--pairs", type=int, default=2, help="DPO micro batch (pairs); SFT takes twice as many rows")
    options = parser.parse_args(argv)
    world.measuring_process(options.threads)
    world.init_world()
    load_before = os.getloadavg()[0]
    args = llama_settings(options, 2 * options.pairs, options.zero_stage)

    before_models_kib = status_kib("VmRSS")
    engine = world.build_engine(build_model(args.architecture(), args.seed), args.deepspeed_config())
    generator = torch.Generator().manual_seed(0)
    rows = 2 * options.pairs
    text = torch.randint(0, options.vocab, (rows, options.seq + 1), generator=generator)
    label = text.clone()
    label[:, : options.seq // 4] = -100  # the prompt
    live, precomputed = preference_samples(options.objective, text, label, generator)
    name_live, name_precomputed = options.objective, f"{options.objective}_precomputed"
    runs = {"sft": (LanguageModelLoss(BatchOptions()), {"text": text, "label": label}),
            name_precomputed: (preference_objective(options.objective), precomputed)}
    peak_mib: dict[str, list[float]] = {name: [] for name in ("sft", name_precomputed, name_live)}
    times: dict[str, list[float]] = {name: [] for name in peak_mib}

    def measured(name: str) -> None:
        objective, samples = runs[name]
        measure_memory(lambda: times[name].append(step(engine, objective, samples)))
        peak_mib[name].append((status_kib("VmHWM") - before_models_kib) / 1024)

    for name in ("sft", name_precomputed):  # warm-up: kernels, optimizer state
        step(engine, *runs[name])
    for _ in range(options.repeats):
        for name in ("sft", name_precomputed):
            measured(name)
    reference_started = status_kib("VmRSS")
    reference = frozen_reference_engine(args)  # as training builds it, without the checkpoint load
    reference_mib = (status_kib("VmRSS") - reference_started) / 1024
    runs[name_live] = (preference_objective(options.objective, reference), live)
    step(engine, *runs[name_live])
    times = {name: [] for name in times}  # time all three side by side after this, the order rotating
    order = ["sft", name_live, name_precomputed]
    for repeat in range(options.repeats):
        for name in in_turn(order, repeat):
            if name == name_live:
                measured(name)
            else:
                times[name].append(step(engine, *runs[name]))

    load_average = (load_before, os.getloadavg()[0])
    parameters = sum(p.numel() for p in engine.module.parameters())
    unit = f"{rows} sequences" if options.objective == "kto" else f"{options.pairs} pairs"
    batch = f"{options.objective.upper()} micro batch {unit} x {options.seq} tokens"
    print(f"shapes: Llama family, {parameters / 1e6:.1f}M parameters ({options.layers} layers, hidden {options.hidden}, "
          f"vocab {options.vocab}), {options.precision}, ZeRO stage {options.zero_stage}, Adam; {batch}, "
          f"SFT {rows} rows; repeats {options.repeats}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; load average {load_average[1]:.2f}; "
          f"reference model resident: {reference_mib:.1f} MiB")
    print(step_table(times, peak_mib, order))
    report = Ratios()
    title = options.objective.upper()

    def per_repeat(name: str) -> list[float]:
        return repeat_ratios(times[name], times["sft"])

    report.add(f"{name_live}/sft step_seconds", median(times[name_live]), median(times["sft"]),
               f"a {title} step (live reference) against an SFT step on as many sequences", per_repeat(name_live))
    report.add(f"{name_precomputed}/sft step_seconds", median(times[name_precomputed]),
               median(times["sft"]),
               f"a {title} step reading precomputed reference log-probabilities against the SFT step",
               per_repeat(name_precomputed))
    report.add(f"{name_live}/sft peak_rss", median(peak_mib[name_live]), median(peak_mib["sft"]),
               f"peak memory of the {title} step (reference resident) against the SFT step")
    report.add(f"{name_precomputed}/{name_live} peak_rss", median(peak_mib[name_precomputed]),
               median(peak_mib[name_live]), "below 1: the memory precompute_model_name saves")
    write_json(options, __doc__, report, load_average, step_seconds=times, peak_mib=peak_mib,
               reference_mib=reference_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
