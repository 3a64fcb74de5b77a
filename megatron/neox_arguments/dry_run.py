"""The --dry-run report: every setting with the file that set it, and the DeepSpeed config, as YAML."""

from __future__ import annotations

from typing import Any

import yaml

from megatron.neox_arguments.arguments import NeoXArgs


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def render_dry_run(args: NeoXArgs) -> str:
    lines = ["# every setting, then the file that set it (default: nobody did; derived: computed)", "settings:"]
    for name, value in args.to_dict().items():
        if name == "config_files" and value:
            value = sorted(value)  # the names; their text is kept for checkpoints
        lines.append(f"  {name}: {_flow(value)}  # {args.source_of(name)}")
    lines.append("deepspeed_config:")
    body = yaml.safe_dump(args.deepspeed_config(), default_flow_style=False, sort_keys=False)
    lines += ["  " + line for line in body.splitlines()]
    return "\n".join(lines) + "\n"
