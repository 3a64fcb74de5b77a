"""Write docs/configuration.md: the guide in configuration_guide.md, then every setting of the schema and
every GPT-NeoX key handled here, generated from megatron/neox_arguments/schema.py and foreign.py.

    python tools/docs/configuration.py > docs/configuration.md

tests/e2e/test_docs_generated.py runs it and fails when the committed file differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron.neox_arguments.foreign import (  # noqa: E402
    ALIASES,
    GLOBAL_ATTENTION,
    GPT_NEOX_ONLY_VALUES,
    INERT,
    TENSOR_PARALLEL_ONLY,
    UNSUPPORTED,
    VALUE_ALIASES,
)
from megatron.neox_arguments.schema import SETTINGS_LIST, Setting  # noqa: E402

COMMAND = "python tools/docs/configuration.py > docs/configuration.md"
GUIDE = Path(__file__).with_name("configuration_guide.md")

GROUP_TITLES = {
    "model": "Model",
    "training": "Training and optimisation",
    "deepspeed": "DeepSpeed keys (written into the DeepSpeed config when not at their default)",
    "logging": "Evaluation and logging",
    "generation": "Text generation (generate.py)",
    "evaluation": "LM Evaluation Harness (eval.py)",
    "checkpointing": "Checkpoints",
    "data": "Data and tokenizer",
    "launcher": "Launcher and ranks",
    "derived": "Derived (computed from the others; a config may not set them)",
}


def cell(text: str) -> str:
    """Prose safe inside one cell of a Markdown table."""
    return text.replace("|", "\\|").replace("<", "\\<").replace("\n", " ")


def code(value: Any) -> str:
    """A value as a config file writes it, as inline code inside a table cell."""
    written = "null" if value is None else json.dumps(value)
    return "`" + written.replace("|", "\\|") + "`"


def type_name(setting: Setting) -> str:
    types = setting.type if isinstance(setting.type, tuple) else (setting.type,)
    if float in types:  # an int is accepted wherever a float is
        types = tuple(kind for kind in types if kind is not int)
    names = [kind.__name__ for kind in types if kind is not type(None)]
    return " or ".join(names) + (" or null" if type(None) in types else "")


def meaning(setting: Setting) -> str:
    text = setting.doc
    if setting.choices is not None:
        text += "; one of " + ", ".join(code(choice) for choice in setting.choices if choice is not None)
    if not setting.gpt_neox:
        text += " (ours; GPT-NeoX has no such setting)"
    return cell(text)


def settings_tables() -> list[str]:
    lines = ["## Every setting", "",
             "Generated from `megatron/neox_arguments/schema.py`, the one place a setting is defined. Every "
             "setting GPT-NeoX also has keeps GPT-NeoX's name, meaning and default; the ones GPT-NeoX lacks "
             "say so.", ""]
    for group, title in GROUP_TITLES.items():
        lines += [f"### {title}", "", "| setting | type | default | meaning |", "|---|---|---|---|"]
        lines += [f"| `{setting.name}` | {type_name(setting)} | {code(setting.default)} | {meaning(setting)} |"
                  for setting in SETTINGS_LIST if setting.group == group]
        lines.append("")
    missing = {setting.group for setting in SETTINGS_LIST} - set(GROUP_TITLES)
    if missing:
        raise SystemExit(f"tools/docs/configuration.py: give the schema group(s) {sorted(missing)} a title")
    return lines


def foreign_tables() -> list[str]:
    lines = ["## GPT-NeoX keys handled here", "",
             "Generated from `megatron/neox_arguments/foreign.py`: GPT-NeoX settings this framework does not "
             "have as settings of its own.", "",
             "### Other names for our settings", "", "| GPT-NeoX name | our setting |", "|---|---|"]
    lines += [f"| `{name}` | `{target}` |" for name, target in ALIASES.items()]
    lines += ["", "GPT-NeoX spellings of values:", "", "| setting | GPT-NeoX value | our value |", "|---|---|---|"]
    lines += [f"| `{name}` | {code(given)} | {code(ours)} |"
              for name, values in VALUE_ALIASES.items() for given, ours in values.items()]
    lines += ["", "### Only at a tensor-parallel size above 1", "",
              "At `model_parallel_size: 1` these change nothing (a notice, as GPT-NeoX ignores them there). "
              "Above 1, the value built here is accepted with a notice and any other is an error.", "",
              "| key | built here | accepted values | another value asks for |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {cell(rule.built)} | {cell(rule.is_built.values)} | {cell(rule.other)} |"
              for name, rule in TENSOR_PARALLEL_ONLY.items()]
    lines += ["", "### Accepted with a one-line notice (no effect here)", "", "| key | why it has no effect |",
              "|---|---|", f"| `attention_config` of global or flash attention | {cell(GLOBAL_ATTENTION)} |"]
    lines += [f"| `{name}` | {cell(reason)} |" for name, reason in sorted(INERT.items())]
    lines += ["", "### Errors when switched on", "",
              "A GPT-NeoX feature not built here: a value that leaves it off is accepted with a notice, any other "
              "stops the run with the message below.", "",
              "| key | accepted values | message |", "|---|---|---|"]
    lines += [f"| `{name}` | {cell(off.values)} | {cell(message)} |"
              for name, (off, message) in sorted(UNSUPPORTED.items())]
    lines += ["", "### Values of our settings that select a GPT-NeoX feature not built here", "",
              "| setting | value | feature (an error) |", "|---|---|---|"]
    lines += [f"| `{name}` | {code(value)} | {cell(feature)} |"
              for name, values in GPT_NEOX_ONLY_VALUES.items() for value, feature in values.items()]
    lines.append("")
    return lines


def document() -> str:
    head = ["# Configuration", "",
            f"<!-- Generated by `{COMMAND}` from tools/docs/configuration_guide.md, "
            "megatron/neox_arguments/schema.py and foreign.py. Edit those, not this file. -->", ""]
    return "\n".join(head) + GUIDE.read_text().rstrip("\n") + "\n\n" + "\n".join(settings_tables() + foreign_tables())


if __name__ == "__main__":
    sys.stdout.write(document())
