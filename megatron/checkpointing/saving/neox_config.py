"""The run's settings as one complete GPT-NeoX YAML, written into every tag's configs/ folder.

The YAML files a run was started with are copied there too, but a run usually needs several (a model
file and a local setup), and GPT-NeoX's tools (tools/ckpts/convert_neox_to_hf.py, ...) read one. This
one describes the files of the tag as written:

- pipe_parallel_size 0 for a run without a pipeline (0 or 1): the module sits in
  mp_rank_<MP>_model_states.pt under ``sequential.<i>.<name>``, GPT-NeoX's layout for a model without a
  pipeline; GPT-NeoX's tools take pipe_parallel_size >= 1 to mean one layer_<II>-model_<MP>-model_states.pt
  file per layer, which a pipelined run (pipe_parallel_size > 1) writes, and records its size.
- model_parallel_size: the number of mp_rank files.
- sizes left unset (intermediate_size: 4 x hidden, num_kv_heads, max_position_embeddings) as the
  architecture resolves them, because GPT-NeoX's tools do not derive them; intermediate_size keeps
  GPT-NeoX's meaning (the width before GPT-NeoX's MLP rule, megatron/contract/architecture.py). Settings left
  unset otherwise are omitted, so a reader's default applies.
- the tokenizer the run used (tokenizer_type, vocab_file, merge_file), its files as absolute paths; a
  run on the embedded corpus is written as a run on that corpus's dataset and tokenizer file.
- fp16 / bf16 sections that say the precision, which GPT-NeoX's tools read from them.
- only settings GPT-NeoX has (a field of its NeoXArgs, so its own loader accepts the file); the ones it
  does not have (declared with ``gpt_neox=False`` in the schema) go to neox_config_extra.yml beside it.

Our own loader reads the two files back as the same run (derived settings are left out: they are
derived again).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megatron.checkpointing.ondisk.layout import NEOX_CONFIG_EXTRA_FILE
from megatron.contract.architecture import architecture_from_settings, ungated_mlp_width


def resolved_neox_config(settings: dict[str, Any]) -> dict[str, Any]:
    """The YAML content for `settings` (NeoXArgs.to_dict() of the run, after its tokenizer is chosen)."""
    from megatron.neox_arguments import SETTINGS

    values = {name: value for name, value in settings.items()
              if value is not None and name in SETTINGS and not SETTINGS[name].derived}
    arch = architecture_from_settings({**{n: s.default for n, s in SETTINGS.items()}, **settings})
    values.update(intermediate_size=ungated_mlp_width(arch.hidden_size, settings.get("intermediate_size")),
                  num_kv_heads=arch.num_kv_heads, max_position_embeddings=arch.max_position_embeddings)
    stages = int(settings.get("pipe_parallel_size") or 0)
    values["pipe_parallel_size"] = stages if stages > 1 else 0
    values["model_parallel_size"] = int(settings.get("model_parallel_size") or 1)
    for name in ("vocab_file", "merge_file"):
        if values.get(name):
            values[name] = str(Path(values[name]).expanduser().resolve())
    if values.get("embedded_corpus"):
        values["embedded_corpus"] = False  # data_path and the tokenizer now name the corpus's files
    precision = settings.get("precision")
    for name in ("fp16", "bf16"):
        if precision == name and not (values.get(name) or {}).get("enabled"):
            values[name] = {**(values.get(name) or {}), "enabled": True}
    return values


def split_by_gpt_neox(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the settings GPT-NeoX has, the ones it does not) of `values`, each in the given order."""
    from megatron.neox_arguments import SETTINGS

    ours = {name for name in values if not SETTINGS[name].gpt_neox}
    return ({name: value for name, value in values.items() if name not in ours},
            {name: value for name, value in values.items() if name in ours})


def write_neox_config(settings: dict[str, Any], path: Path) -> Path:
    """Write `path` (neox_config.yml) and, when the run has settings GPT-NeoX lacks, neox_config_extra.yml."""
    path.parent.mkdir(parents=True, exist_ok=True)
    gpt_neox, ours = split_by_gpt_neox(resolved_neox_config(settings))
    header = ("# Every setting of the run that saved this checkpoint, as one GPT-NeoX config; the settings "
              f"GPT-NeoX does not have are in {NEOX_CONFIG_EXTRA_FILE} (megatron/checkpointing/saving/neox_config.py)\n")
    path.write_text(header + yaml.safe_dump(gpt_neox, sort_keys=False))
    if ours:
        extra_header = (f"# The settings of the run GPT-NeoX does not have; {path.name} holds all the others\n")
        (path.parent / NEOX_CONFIG_EXTRA_FILE).write_text(extra_header + yaml.safe_dump(ours, sort_keys=False))
    return path
