"""Reading GPT-NeoX style YAML files and merging them, remembering which file set each key.

The dialect: YAML (so JSON-style braces work too), `#` comments, keys written with `-` or `_`.
Later files override earlier ones key by key at the top level; a nested dict given again
replaces the earlier one as a whole (as in GPT-NeoX), it is not merged. The data source is one
choice: a later file that sets data_path, train_data_paths or embedded_corpus replaces the
others set by earlier files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.foreign import canonical_names

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"


def normalise_key(key: str) -> str:
    return key.strip().replace("-", "_")


@dataclass
class MergedConfig:
    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # setting name -> file that set it last
    texts: dict[str, str] = field(default_factory=dict)  # file basename -> raw text


def resolve_config_path(path: str | Path) -> Path:
    """The path as given if it exists, else the same path under configs/."""
    given = Path(path)
    if given.is_file():
        return given
    under_configs = CONFIGS_DIR / given
    if under_configs.is_file():
        return under_configs
    raise ConfigError(f"config file {str(path)!r} not found (looked at {given.resolve()} and {under_configs})")


def gpt_neox_config_paths(names: list[str], conf_dir: str | None = None) -> list[str]:
    """Config paths as GPT-NeoX's deepy.py reads its arguments: `-d DIR` is put in front of every name,
    and a name without .yml/.json gets .yml (`125M` is `125M.yml`)."""
    paths = [os.path.join(conf_dir, name) if conf_dir else name for name in names]
    return [path if path.endswith((".yml", ".json")) else path + ".yml" for path in paths]


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int):
        super().__init__(f"key {key!r} is set twice (the second time on line {line}); keep one")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys in a mapping without a word; here it is an error."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may override what it merges
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str | int | float | bool) or key is None:
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_config_text(path: Path) -> str:
    """The file's text; ConfigError in one line for a file that is not UTF-8 text (a binary file, a
    checkpoint, an archive named in place of the YAML) or cannot be read."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot be read ({err.strerror}); check the path and its "
                          "permissions") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path}: byte {err.start} is not UTF-8 text, so this is not a YAML "
                          "config file (a binary file?); name the YAML file of settings") from None
    if "\x00" in text:
        raise ConfigError(f"config file {path}: byte {text.index(chr(0))} is a NUL byte, so this is not a YAML "
                          "config file (a binary file?); name the YAML file of settings")
    return text


def parse_config_text(text: str, source: str) -> dict[str, Any]:
    """Top-level keys normalised to underscores; the same key written twice is an error."""
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as err:
        raise ConfigError(f"{source}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(err).split())}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: expected a mapping of settings at the top level, got {type(loaded).__name__}")
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in loaded.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: key {key!r} is not a string")
        name = normalise_key(key)
        if name in values:
            raise ConfigError(f"{source}: key {name!r} is set twice (as {spelled[name]!r} and {key!r}); keep one")
        values[name] = value
        spelled[name] = key
    return values


# Settings that choose the training data are alternatives: a later file choosing one of them
# replaces what earlier files chose (model config + local_setup.yml with the user's data).
DATA_SOURCE_ALTERNATIVES = (
    ("data_path",),
    ("train_data_paths", "valid_data_paths", "test_data_paths",
     "train_data_weights", "valid_data_weights", "test_data_weights",
     "train_label_data_paths", "valid_label_data_paths", "test_label_data_paths",
     *(f"{split}_reward_data_paths" for split in ("train", "valid", "test")),
     *(f"{sign}_{split}_{kind}data_paths" for split in ("train", "valid", "test") for sign in ("pos", "neg")
       for kind in ("", "label_"))),
    ("embedded_corpus",),
)


def _drop_replaced_data_sources(merged: MergedConfig, incoming: dict[str, Any]) -> None:
    for chosen in DATA_SOURCE_ALTERNATIVES:
        if any(incoming.get(name) for name in chosen):
            for others in DATA_SOURCE_ALTERNATIVES:
                if others is not chosen:
                    for name in others:
                        merged.values.pop(name, None)
                        merged.sources.pop(name, None)


def merge_config_files(paths: list[str | Path]) -> MergedConfig:
    if not paths:
        raise ConfigError("no config file given; pass at least one YAML file")
    merged = MergedConfig()
    for given in paths:
        path = resolve_config_path(given)
        text = read_config_text(path)
        if path.name in merged.texts and merged.texts[path.name] != text:
            raise ConfigError(
                f"two different config files are both named {path.name!r}; checkpoints store them by name, rename one"
            )
        merged.texts[path.name] = text
        incoming = canonical_names(parse_config_text(text, str(path)), str(path))
        _drop_replaced_data_sources(merged, incoming)
        for name, value in incoming.items():
            merged.values[name] = value
            merged.sources[name] = str(path)
    return merged
