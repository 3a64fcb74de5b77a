"""NeoXArgs: the validated settings of one run, read as attributes (``args.hidden_size``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from megatron.neox_arguments.deepspeed_config import build_deepspeed_config
from megatron.neox_arguments.derived import derive_all
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.foreign import canonical_names, take_foreign_settings
from megatron.neox_arguments.schema import SETTINGS
from megatron.neox_arguments.validation import check_settings
from megatron.neox_arguments.yaml_files import merge_config_files, normalise_key

DEFAULT_SOURCE = "default"
DERIVED_SOURCE = "derived"
# derived settings the loader never computes: the trainer sets them (padded_vocab_size comes from the
# tokenizer), so library code may pass them to from_dict; a YAML may not set them
SET_BY_CALLER = ("padded_vocab_size",)


class NeoXArgs:
    """Every setting of the schema as an attribute; unset ones hold their default.

    Build one with `from_yaml_files` or `from_dict` (validated, derived values filled in). The
    constructor itself takes values as they are; it is how already validated settings are restored.
    """

    def __init__(self, values: dict[str, Any], sources: dict[str, str] | None = None,
                 notices: list[str] | None = None):
        for name, setting in SETTINGS.items():
            setattr(self, name, copy.deepcopy(setting.default))
        for name, value in values.items():
            setattr(self, name, value)
        self._sources = dict(sources) if sources is not None else dict.fromkeys(values, "<constructor>")
        self._notices = list(notices or [])

    @classmethod
    def from_yaml_files(cls, paths: list[str | Path]) -> NeoXArgs:
        """Merge the files (later ones override earlier ones key by key), validate, derive."""
        merged = merge_config_files(paths)
        args = cls._validated(merged.values, merged.sources, require_run_settings=True, allowed_derived=())
        args.config_files = merged.texts
        return args

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "<dict>", *,
                  require_run_settings: bool = False) -> NeoXArgs:
        """Validate and derive from a plain dict of settings, as if it were one config file.

        By default a model-only dict is enough (library code, tests): what a training run needs
        besides the model (train_iters, lr, batch sizes, data) is checked only when given, unless
        `require_run_settings` (what from_yaml_files always does). padded_vocab_size may be given.
        """
        given = canonical_names({normalise_key(k): v for k, v in values.items()}, source)
        return cls._validated(given, dict.fromkeys(given, source), require_run_settings, SET_BY_CALLER)

    @classmethod
    def _validated(cls, given: dict[str, Any], sources: dict[str, str], require_run_settings: bool,
                   allowed_derived: tuple[str, ...]) -> NeoXArgs:
        given = copy.deepcopy(given)
        notices = take_foreign_settings(given, sources)
        checked = check_settings(given, sources, allowed_derived)
        sources = {name: sources[name] for name in checked}
        values = {name: copy.deepcopy(setting.default) for name, setting in SETTINGS.items()}
        values.update(checked)
        derive_all(values, sources, require_run_settings, notices)
        if values["train_batch_size"] is not None and values["lr"] is not None:
            build_deepspeed_config(values)  # its conflicts are config errors too; raise them now
        for name, setting in SETTINGS.items():
            if name not in sources:
                changed = setting.derived or values[name] != setting.default
                sources[name] = DERIVED_SOURCE if changed else DEFAULT_SOURCE
        return cls(values, sources, notices)

    def to_dict(self) -> dict[str, Any]:
        return {name: copy.deepcopy(getattr(self, name)) for name in SETTINGS}

    def source_of(self, name: str) -> str:
        """The config file that set `name`, or "default" / "derived"."""
        if name not in SETTINGS:
            raise KeyError(f"{name!r} is not a setting")
        return self._sources.get(name, DEFAULT_SOURCE)

    @property
    def sources(self) -> dict[str, str]:
        return {name: self.source_of(name) for name in SETTINGS}

    @property
    def notices(self) -> list[str]:
        """One line per accepted GPT-NeoX setting that has no effect here."""
        return list(self._notices)

    def deepspeed_config(self) -> dict[str, Any]:
        missing = [name for name in ("train_batch_size", "lr") if getattr(self, name) is None]
        if missing:
            raise ConfigError(
                f"no DeepSpeed config without {' and '.join(missing)}; these settings were built from a "
                "model-only dict (from_dict without require_run_settings)"
            )
        return build_deepspeed_config(self.to_dict())

    def __repr__(self) -> str:
        return f"NeoXArgs({self.to_dict()!r})"
