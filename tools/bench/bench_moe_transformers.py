"""A Mixtral-style mixture-of-experts step of ours against transformers' `MixtralForCausalLM`, both under DeepSpeed.

    python tools/bench/bench_moe_transformers.py [--layers 4] [--hidden 512] [--heads 8] [--seq 256]
        [--vocab 8192] [--precision bf16|fp32] [--zero-stage 1] [--experts 8] [--top-k 2] [--expert-width 512]
        [--micro-batch 2] [--steps 4] [--repeats 3] [--threads N] [--json PATH]

One Hugging Face Mixtral folder (fp32 safetensors, written once: `--experts` experts `--expert-width` wide,
top-k routing, in every layer) is what both sides fine-tune in full. Each measurement is a fresh process, the two
sides alternating every repeat:

| row            | the model                                                                                |
| `ours`         | `load: <folder>`: our model built from the folder's settings, its weights through the load |
|                | plan; the experts run as the start-up line says (grouped matmul where the platform has it)  |
| `transformers` | `AutoModelForCausalLM.from_pretrained(<folder>)` (`MixtralForCausalLM`)                    |

Both train every parameter in a DeepSpeed engine of the same config (Adam, `--precision`, ZeRO `--zero-stage`)
on the same batch; the loss is the mean next-token cross entropy in fp32 on both sides (the router's auxiliary
loss left out of both: transformers computes it only when asked for the router logits). The first losses of the
two sides are printed. Memory: the process's peak RSS (VmHWM) above its RSS before the model was built.
Ratios: `ours/transformers step_seconds` (goal at most 1.0) and `ours/transformers peak_rss`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Ratios, bench_parser, repeat_ratios, step_table, variants_in_fresh_processes, write_json  # noqa: E402

VARIANTS = ("ours", "transformers")


def mixtral_config(options: argparse.Namespace):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=options.vocab, hidden_size=options.hidden, intermediate_size=options.expert_width,
                         num_hidden_layers=options.layers, num_attention_heads=options.heads,
                         num_key_value_heads=max(options.heads // 2, 1), max_position_embeddings=options.seq,
                         num_local_experts=options.experts, num_experts_per_tok=options.top_k,
                         tie_word_embeddings=False)


def measure_variant(options: argparse.Namespace) -> dict:
    """In this process: build ``options.variant``'s engine from the folder, time its steps, read its peak memory."""
    import bench_world as world
    import peer_models
    import transformers
    from procmem import status_kib

    import megatron.model  # noqa: F401  (both sides start with every library imported)

    world.measuring_process(options.threads)
    world.init_world()
    before_kib = status_kib("VmRSS")
    with tempfile.TemporaryDirectory(prefix="bench_moe_transformers_") as scratch:
        if options.variant == "ours":
            engine = peer_models.our_engine(Path(options.folder), options, Path(scratch))
            loss_of = peer_models.our_loss
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(options.folder)
            engine, loss_of = peer_models.their_engine(model, options), peer_models.their_loss
        first_loss, seconds = peer_models.timed_steps(engine, loss_of, peer_models.batch(options, options.vocab),
                                                      options.steps)
    return {"step_seconds": seconds, "peak_mib": (status_kib("VmHWM") - before_kib) / 1024,
            "first_loss": first_loss, "parameters": sum(p.numel() for p in engine.module.parameters())}


def _shared_flags(options: argparse.Namespace) -> list[str]:
    return [flag for name in ("layers", "hidden", "heads", "seq", "vocab", "precision", "zero_stage", "experts",
                              "top_k", "expert_width", "micro_batch", "steps", "threads", "folder")
            for flag in (f"--{name.replace('_', '-')}", str(getattr(options, name)))]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=4, hidden=512, heads=8, vocab=8192, seq=256, precision="bf16",
                          zero_stage=1, zero_stages=(0, 1, 2), repeats=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process (their median is its time)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one measuring process
    parser.add_argument("--folder", help=argparse.SUPPRESS)  # the Hugging Face folder the parent wrote
    options = parser.parse_args(argv)
    if options.variant:
        print(json.dumps(measure_variant(options)))
        return 0

    import peer_models

    with tempfile.TemporaryDirectory(prefix="bench_moe_transformers_") as scratch:
        options.folder = str(peer_models.save_folder(mixtral_config(options), Path(scratch) / "mixtral"))
        results, load_average = variants_in_fresh_processes(__file__, VARIANTS, options.repeats,
                                                             _shared_flags(options))
    times = {variant: [r["step_seconds"] for r in runs] for variant, runs in results.items()}
    peaks = {variant: [r["peak_mib"] for r in runs] for variant, runs in results.items()}
    ours, theirs = results["ours"][0], results["transformers"][0]
    print(f"shapes: Mixtral, {ours['parameters'] / 1e6:.1f}M parameters ({options.layers} layers, hidden "
          f"{options.hidden}, {options.experts} experts {options.expert_width} wide, top {options.top_k}, vocab "
          f"{options.vocab}), {options.precision}, ZeRO stage {options.zero_stage}, Adam; micro batch "
          f"{options.micro_batch} x {options.seq} tokens; repeats {options.repeats}; load average {load_average[1]:.2f}")
    print(f"first loss: ours {ours['first_loss']:.6f}, transformers {theirs['first_loss']:.6f}")
    print(step_table(times, peaks, VARIANTS))
    report = Ratios()
    report.add("ours/transformers step_seconds", median(times["ours"]), median(times["transformers"]),
               "our MoE step against transformers' Mixtral (goal <= 1.0)",
               repeat_ratios(times["ours"], times["transformers"]))
    report.add("ours/transformers peak_rss", median(peaks["ours"]), median(peaks["transformers"]),
               "our MoE run's peak memory against transformers'", repeat_ratios(peaks["ours"], peaks["transformers"]))
    write_json(options, __doc__, report, load_average, step_seconds=times, peak_mib=peaks,
               first_loss={variant: [r["first_loss"] for r in runs] for variant, runs in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
