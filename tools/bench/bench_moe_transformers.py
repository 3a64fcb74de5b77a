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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import bench_parser  # noqa: E402

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
    import peer_models
    import transformers

    return peer_models.measure(options, {}, transformers.AutoModelForCausalLM.from_pretrained)


def _shapes(options: argparse.Namespace, ours: dict) -> str:
    return (f"shapes: Mixtral, {ours['parameters'] / 1e6:.1f}M parameters ({options.layers} layers, hidden "
            f"{options.hidden}, {options.experts} experts {options.expert_width} wide, top {options.top_k}, vocab "
            f"{options.vocab}), {options.precision}, ZeRO stage {options.zero_stage}, Adam; micro batch "
            f"{options.micro_batch} x {options.seq} tokens")


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

    flags = [flag for name in ("layers", "hidden", "heads", "seq", "vocab", "precision", "zero_stage", "experts",
                               "top_k", "expert_width", "micro_batch", "steps", "threads")
             for flag in (f"--{name.replace('_', '-')}", str(getattr(options, name)))]
    peer_models.compare(__file__, __doc__, options, mixtral_config(options), "transformers", flags,
                        ("our MoE step against transformers' Mixtral (goal <= 1.0)",
                         "our MoE run's peak memory against transformers'"),
                        lambda ours, theirs: _shapes(options, ours))
    return 0


if __name__ == "__main__":
    sys.exit(main())
