"""Every tag's configs/neox_config.yml loads in GPT-NeoX's own NeoXArgs: it holds only keys of GPT-NeoX's
dataclass (their list is kept as data, tests/fixtures/gpt_neox/neox_args_fields.txt); the settings GPT-NeoX
does not have are written beside it, and the two files read back as the run that saved them."""

from __future__ import annotations

from pathlib import Path

import yaml

from megatron.checkpointing.ondisk.layout import NEOX_CONFIG_EXTRA_FILE
from megatron.checkpointing.saving.neox_config import write_neox_config
from megatron.neox_arguments import SETTINGS, NeoXArgs
from tests.unit.test_neox_args import TINY_RUN

FIELDS_FILE = Path(__file__).parents[1] / "fixtures" / "gpt_neox" / "neox_args_fields.txt"


def gpt_neox_fields() -> set[str]:
    return {line.strip() for line in FIELDS_FILE.read_text().splitlines() if line.strip() and not line.startswith("#")}


def keys_gpt_neox_refuses(config_file: Path) -> set[str]:
    """What GPT-NeoX's NeoXArgs.from_ymls would call an unexpected keyword argument: every key, dashes made
    underscores as it makes them, that is not a field of its dataclass."""
    return {str(key).replace("-", "_") for key in yaml.safe_load(config_file.read_text())} - gpt_neox_fields()


# a run that sets every setting GPT-NeoX lacks (GPT-NeoX refused such configs with `unexpected keyword argument`)
OUR_OWN = {"max_nonfinite_steps": 3, "torch_compile": True, "save_interval": 7, "load_module_strict": False,
           "load_module_allow_random": ["sequential.*.mlp.*"]}


def saved_configs(tmp_path) -> tuple[NeoXArgs, Path]:
    args = NeoXArgs.from_dict({**TINY_RUN, **OUR_OWN, "embedded_corpus": False, "data_path": "/data/x_text_document",
                               "load": "/ckpt", "padded_vocab_size": 512,
                               "tokenizer_type": "CharLevelTokenizer"}, require_run_settings=True)
    return args, write_neox_config(args.to_dict(), tmp_path / "configs" / "neox_config.yml")


def test_neox_config_holds_only_keys_gpt_neox_accepts_and_the_rest_is_beside_it(tmp_path):
    _, path = saved_configs(tmp_path)
    assert keys_gpt_neox_refuses(path) == set()
    extra = yaml.safe_load((path.parent / NEOX_CONFIG_EXTRA_FILE).read_text())
    assert set(OUR_OWN) | {"embedded_corpus"} <= set(extra) and not set(extra) & gpt_neox_fields()


def test_the_two_files_read_back_as_the_run_that_saved_them(tmp_path):
    args, path = saved_configs(tmp_path)
    reread = NeoXArgs.from_yaml_files([path, path.parent / NEOX_CONFIG_EXTRA_FILE])
    # the model's sizes are written resolved (intermediate_size, num_kv_heads, ...): the same model
    assert reread.with_values({"padded_vocab_size": 512}, "test").architecture() == args.architecture()
    for name, setting in SETTINGS.items():
        if not setting.derived and setting.group != "model":
            assert getattr(reread, name) == getattr(args, name), name


def test_the_schema_says_which_settings_gpt_neox_has_as_gpt_neox_does():
    """The rule the split follows (Setting.gpt_neox) against GPT-NeoX's own field list: a setting added to the
    schema is written into neox_config.yml only if GPT-NeoX has it."""
    fields = gpt_neox_fields()
    wrong = {name for name, setting in SETTINGS.items() if setting.gpt_neox != (name in fields)}
    assert wrong == set()
