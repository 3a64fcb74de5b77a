"""A LoRA fine-tune step of ours against PEFT's on transformers, both under DeepSpeed: step time and memory.

    python tools/bench/bench_lora_peft.py [--layers 4] [--hidden 512] [--heads 8] [--seq 256] [--vocab 8192]
        [--precision bf16|fp32] [--zero-stage 1] [--lora-rank 16] [--micro-batch 2] [--steps 4] [--repeats 3]
        [--threads N] [--json PATH]

One Hugging Face Llama folder (fp32 safetensors, written once) is what both sides fine-tune. Each measurement is
a fresh process, the two sides alternating every repeat:

| row    | the model                                                                                               |
| `ours` | `load: <folder>` with `lora_rank`, `lora_alpha` 2 x rank, `lora_target_modules: all-linear`: our model   |
|        | built from the folder's settings, its weights through the load plan, adapters drawn, the base frozen    |
| `peft` | `AutoModelForCausalLM.from_pretrained(<folder>)` wrapped by `peft.get_peft_model` with the same rank,    |
|        | alpha and targets (`all-linear`), no dropout                                                            |

Both train in a DeepSpeed engine of the same config (Adam, `--precision`, ZeRO `--zero-stage`) with the
parameters that require a gradient, on the same batch, loss = mean next-token cross entropy in fp32 (the first
losses of the two sides are printed: the same model computes the same loss up to the precision's rounding).
Memory: the process's peak RSS (VmHWM) above its RSS before the model was built (libraries imported). Ratios:
`ours/peft step_seconds` (goal at most 1.0), `ours/peft peak_rss` (goal at most 1.0).
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

VARIANTS = ("ours", "peft")


def llama_config(options: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=options.vocab, hidden_size=options.hidden, intermediate_size=4 * options.hidden,
                       num_hidden_layers=options.layers, num_attention_heads=options.heads,
                       num_key_value_heads=max(options.heads // 2, 1), max_position_embeddings=options.seq,
                       tie_word_embeddings=False)


def measure_variant(options: argparse.Namespace) -> dict:
    """In this process: build ``options.variant``'s engine from the folder, time its steps, read its peak memory."""
    import bench_world as world
    import peer_models
    import peft
    import transformers
    from procmem import status_kib

    import megatron.model  # noqa: F401  (both sides start with every library imported)

    world.measuring_process(options.threads)
    world.init_world()
    before_kib = status_kib("VmRSS")
    with tempfile.TemporaryDirectory(prefix="bench_lora_peft_") as scratch:
        if options.variant == "ours":
            engine = peer_models.our_engine(Path(options.folder), options, Path(scratch),
                                            lora_rank=options.lora_rank, lora_alpha=2 * options.lora_rank,
                                            lora_target_modules="all-linear")
            loss_of = peer_models.our_loss
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(options.folder)
            model = peft.get_peft_model(model, peft.LoraConfig(r=options.lora_rank, lora_alpha=2 * options.lora_rank,
                                                               target_modules="all-linear", lora_dropout=0.0))
            engine, loss_of = peer_models.their_engine(model, options), peer_models.their_loss
        first_loss, seconds = peer_models.timed_steps(engine, loss_of, peer_models.batch(options, options.vocab),
                                                      options.steps)
    parameters = sum(p.numel() for p in engine.module.parameters())
    trained = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return {"step_seconds": seconds, "peak_mib": (status_kib("VmHWM") - before_kib) / 1024,
            "first_loss": first_loss, "parameters": parameters, "trained": trained}


def _shared_flags(options: argparse.Namespace) -> list[str]:
    return [flag for name in ("layers", "hidden", "heads", "seq", "vocab", "precision", "zero_stage", "lora_rank",
                              "micro_batch", "steps", "threads", "folder")
            for flag in (f"--{name.replace('_', '-')}", str(getattr(options, name)))]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, layers=4, hidden=512, heads=8, vocab=8192, seq=256, precision="bf16",
                          zero_stage=1, zero_stages=(0, 1, 2), repeats=3)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process (their median is its time)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one measuring process
    parser.add_argument("--folder", help=argparse.SUPPRESS)  # the Hugging Face folder the parent wrote
    options = parser.parse_args(argv)
    if options.variant:
        print(json.dumps(measure_variant(options)))
        return 0

    import peer_models

    with tempfile.TemporaryDirectory(prefix="bench_lora_peft_") as scratch:
        options.folder = str(peer_models.save_folder(llama_config(options), Path(scratch) / "llama"))
        results, load_average = variants_in_fresh_processes(__file__, VARIANTS, options.repeats,
                                                             _shared_flags(options))
    times = {variant: [r["step_seconds"] for r in runs] for variant, runs in results.items()}
    peaks = {variant: [r["peak_mib"] for r in runs] for variant, runs in results.items()}
    ours, theirs = results["ours"][0], results["peft"][0]
    print(f"shapes: Llama, {ours['parameters'] / 1e6:.1f}M parameters ({options.layers} layers, hidden "
          f"{options.hidden}, vocab {options.vocab}), {options.precision}, ZeRO stage {options.zero_stage}, Adam; "
          f"micro batch {options.micro_batch} x {options.seq} tokens; LoRA rank {options.lora_rank} on all-linear: "
          f"{ours['trained']:,} trained parameters (PEFT: {theirs['trained']:,}); repeats {options.repeats}; "
          f"load average {load_average[1]:.2f}")
    print(f"first loss: ours {ours['first_loss']:.6f}, PEFT {theirs['first_loss']:.6f}")
    print(step_table(times, peaks, VARIANTS))
    report = Ratios()
    report.add("ours/peft step_seconds", median(times["ours"]), median(times["peft"]),
               "our LoRA step against PEFT's on transformers (goal <= 1.0)", repeat_ratios(times["ours"],
                                                                                         times["peft"]))
    report.add("ours/peft peak_rss", median(peaks["ours"]), median(peaks["peft"]),
               "our LoRA run's peak memory against PEFT's (goal <= 1.0)", repeat_ratios(peaks["ours"], peaks["peft"]))
    write_json(options, __doc__, report, load_average, step_seconds=times, peak_mib=peaks,
               first_loss={variant: [r["first_loss"] for r in runs] for variant, runs in results.items()},
               trained_parameters={variant: runs[0]["trained"] for variant, runs in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
