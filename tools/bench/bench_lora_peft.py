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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import bench_parser  # noqa: E402

VARIANTS = ("ours", "peft")


def llama_config(options: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=options.vocab, hidden_size=options.hidden, intermediate_size=4 * options.hidden,
                       num_hidden_layers=options.layers, num_attention_heads=options.heads,
                       num_key_value_heads=max(options.heads // 2, 1), max_position_embeddings=options.seq,
                       tie_word_embeddings=False)


def measure_variant(options: argparse.Namespace) -> dict:
    """In this process: build ``options.variant``'s engine from the folder, time its steps, read its peak memory."""
    import peer_models
    import peft
    import transformers

    def peft_model(folder: str):
        return peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                   peft.LoraConfig(r=options.lora_rank, lora_alpha=2 * options.lora_rank,
                                                   target_modules="all-linear", lora_dropout=0.0))

    lora = {"lora_rank": options.lora_rank, "lora_alpha": 2 * options.lora_rank, "lora_target_modules": "all-linear"}
    return peer_models.measure(options, lora, peft_model)


def _shapes(options: argparse.Namespace, ours: dict, theirs: dict) -> str:
    return (f"shapes: Llama, {ours['parameters'] / 1e6:.1f}M parameters ({options.layers} layers, hidden "
            f"{options.hidden}, vocab {options.vocab}), {options.precision}, ZeRO stage {options.zero_stage}, Adam; "
            f"micro batch {options.micro_batch} x {options.seq} tokens; LoRA rank {options.lora_rank} on all-linear: "
            f"{ours['trained']:,} trained parameters (PEFT: {theirs['trained']:,})")


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

    flags = [flag for name in ("layers", "hidden", "heads", "seq", "vocab", "precision", "zero_stage", "lora_rank",
                               "micro_batch", "steps", "threads")
             for flag in (f"--{name.replace('_', '-')}", str(getattr(options, name)))]
    peer_models.compare(__file__, __doc__, options, llama_config(options), "peft", flags,
                        ("our LoRA step against PEFT's on transformers (goal <= 1.0)",
                         "our LoRA run's peak memory against PEFT's (goal <= 1.0)"),
                        lambda ours, theirs: _shapes(options, ours, theirs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
