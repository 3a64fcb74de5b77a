"""The --dry-run report: every setting with the file that set it, and the DeepSpeed config, as YAML."""

from __future__ import annotations

from typing import Any

import yaml

from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.deepspeed_config import build_inference_deepspeed_config
from megatron.neox_arguments.derived import padded_vocab_size


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def tokenizer_summary(args: NeoXArgs) -> str | None:
    """Build the tokenizer the run will use and say what it is; a TokenizerError if it cannot be built.
    None for the embedded corpus, whose tokenizer is trained on the first run."""
    from megatron.tokenizer import build_tokenizer

    if args.embedded_corpus:
        return None
    tokenizer = build_tokenizer(args)
    padded = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.model_parallel_size)
    return (f"tokenizer: {args.tokenizer_type}, {tokenizer.vocab_size} tokens (padded to {padded}), "
            f"end of document id {tokenizer.eod}")


def render_dry_run(args: NeoXArgs, tokenizer_line: str | None = None) -> str:
    lines = [f"# {tokenizer_line}"] if tokenizer_line else []
    lines += ["# every setting, then the file that set it (default: nobody did; derived: computed)", "settings:"]
    for name, value in args.to_dict().items():
        if name == "config_files" and value:
            value = sorted(value)  # the names; their text is kept for checkpoints
        lines.append(f"  {name}: {_flow(value)}  # {args.source_of(name)}")
    lines.append("deepspeed_config:")
    config = args.deepspeed_config() if args.requires_run_settings else build_inference_deepspeed_config(args.to_dict())
    body = yaml.safe_dump(config, default_flow_style=False, sort_keys=False)
    lines += ["  " + line for line in body.splitlines()]
    return "\n".join(lines) + "\n"
