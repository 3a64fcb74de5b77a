"""NeoXArgs: the validated settings of one run, read as attributes (``args.hidden_size``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from megatron.contract.architecture import Architecture, architecture_from_settings
from megatron.contract.lora_settings import LoraSettings, lora_settings
from megatron.neox_arguments.deepspeed_config import build_deepspeed_config
from megatron.neox_arguments.derived import derive_all
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.foreign import canonical_names, take_foreign_settings
from megatron.neox_arguments.schema import SETTINGS
from megatron.neox_arguments.validation import check_setting, check_settings
from megatron.neox_arguments.yaml_files import merge_config_files, normalise_key

DEFAULT_SOURCE = "default"
COMMAND_LINE_SOURCE = "the command line"
DERIVED_SOURCE = "derived"
# Derived settings the loader does not compute from other settings: code that knows them may state
# them in from_dict (the vocabulary a model was built with; the text of the run's YAML files), and the
# run context resolves padded_vocab_size from the tokenizer. A YAML file may not set them.
GIVEN_BY_CODE = ("padded_vocab_size", "config_files")
# Settings of a saved run that do not describe its model and would not hold for another run: where
# and on how many ranks it ran (the launcher settings; the batch triple depends on that rank count).
NOT_RESTORED = (*(name for name, setting in SETTINGS.items() if setting.group == "launcher"),
                "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class NeoXArgs:
    """Every setting of the schema as an attribute; unset ones hold their default. Read-only.

    Built only by validation: `from_yaml_files`, `from_dict`, `from_saved` (settings a checkpoint
    recorded), or `with_values` (the same given values plus more, validated again).
    """

    def __init__(self, *_args, **_kwargs):
        raise TypeError("NeoXArgs is built by validation: use NeoXArgs.from_yaml_files, from_dict or from_saved")

    @classmethod
    def _create(cls, values: dict[str, Any], sources: dict[str, str], notices: list[str],
                given: dict[str, Any], require_run_settings: bool) -> NeoXArgs:
        args = object.__new__(cls)
        for name in SETTINGS:
            object.__setattr__(args, name, copy.deepcopy(values[name]))
        object.__setattr__(args, "_sources", dict(sources))
        object.__setattr__(args, "_notices", list(notices))
        object.__setattr__(args, "_given", copy.deepcopy(given))
        object.__setattr__(args, "_require_run_settings", require_run_settings)
        return args

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"settings are read-only after validation: cannot set {name!r}. Set it in a config file, or build "
            "new settings with args.with_values({...}) (validated again)"
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def __deepcopy__(self, memo) -> NeoXArgs:
        return self  # read-only: a copy would be the same object

    @classmethod
    def from_yaml_files(cls, paths: list[str | Path], underlay: dict[str, Any] | None = None,
                        underlay_source: str | dict[str, str] = "", overlay: dict[str, Any] | None = None,
                        overlay_source: str = COMMAND_LINE_SOURCE) -> NeoXArgs:
        """Merge the files (later ones override earlier ones key by key), validate, derive.

        `underlay` holds values for settings no file sets (the model a checkpoint recorded), set by
        `underlay_source` (or, a dict, by the source it names for each); a file that sets one of them wins. `overlay` (deepy.py's --eval_tasks, ...)
        wins over every file.
        """
        merged = merge_config_files(paths)
        for name in GIVEN_BY_CODE:
            if name in merged.values:
                check_setting(name, merged.values[name], merged.sources)  # raises: derived, not for a YAML
        overlay = overlay or {}
        filled = {name: value for name, value in (underlay or {}).items() if name not in merged.values}
        given = {**filled, **merged.values, **overlay, "config_files": merged.texts}
        underlay_sources = underlay_source if isinstance(underlay_source, dict) else dict.fromkeys(filled, underlay_source)
        sources = {**{name: underlay_sources[name] for name in filled}, **merged.sources, **dict.fromkeys(overlay, overlay_source),
                   "config_files": DERIVED_SOURCE}
        # Settings that say what to generate (GPT-NeoX's text_generation.yml) or which tasks to score start
        # generate.py or eval.py: the settings only training needs (train_iters, batch sizes, optimizer,
        # data) may then be missing.
        starts_training = given.get("text_gen_type") is None and not given.get("eval_tasks")
        return cls._validated(given, sources, require_run_settings=starts_training)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "<dict>", *,
                  require_run_settings: bool = False) -> NeoXArgs:
        """Validate and derive from a plain dict of settings, as if it were one config file.

        By default a model-only dict is enough (library code, tests): what a training run needs
        besides the model (train_iters, lr, batch sizes, data) is checked only when given, unless
        `require_run_settings` (what from_yaml_files always does). GIVEN_BY_CODE settings may be given.
        """
        given = canonical_names({normalise_key(k): v for k, v in values.items()}, source)
        return cls._validated(given, dict.fromkeys(given, source), require_run_settings)

    @classmethod
    def from_saved(cls, saved: dict[str, Any], source: str, *, require_model: bool = True) -> NeoXArgs:
        """The settings a checkpoint recorded (ours or another program's), as a model-only dict.

        Names this schema does not know, derived values other than padded_vocab_size, and what only
        held for the saving run (NOT_RESTORED) are dropped; GPT-NeoX settings with no effect here
        are dropped; what remains is validated like any config. GPT-NeoX records no seq_length: no
        weight depends on it, max_position_embeddings stands in. Without `require_model` the model's
        shape may be missing (a checkpoint that recorded none). The world is one model replica: the saved
        model_parallel_size x pipe_parallel_size.
        """
        values = canonical_names({normalise_key(str(k)): v for k, v in saved.items()}, source)
        # an unsupported feature that is on raises
        take_foreign_settings(values, dict.fromkeys(values, source), recorded_by_checkpoint=True)
        kept = {name: value for name, value in values.items()
                if name in SETTINGS and name not in NOT_RESTORED and name != "config_files"
                and (not SETTINGS[name].derived or name in GIVEN_BY_CODE)}
        if kept.get("seq_length") is None and kept.get("max_position_embeddings") is not None:
            kept["seq_length"] = kept["max_position_embeddings"]
        # The saving run's launcher is not restored: count the ranks of one model replica (its tensor-parallel
        # group times its pipeline stages), so the saved sizes are checked against a world they fit.
        ranks = 1
        for name in ("model_parallel_size", "pipe_parallel_size"):
            size = kept.get(name)
            if isinstance(size, int) and not isinstance(size, bool) and size > 1:
                ranks *= size
        if ranks > 1:
            kept["num_gpus"] = ranks
        return cls._validated(kept, dict.fromkeys(kept, source), False, require_model)

    def with_values(self, values: dict[str, Any], source: str) -> NeoXArgs:
        """These settings plus `values` (set by `source`), validated again from what was given."""
        given = {**self._given, **values}
        sources = {name: self._sources[name] for name in self._given}
        sources.update(dict.fromkeys(values, source))
        return self._validated(given, sources, self._require_run_settings)

    @classmethod
    def _validated(cls, given: dict[str, Any], sources: dict[str, str], require_run_settings: bool,
                   require_model: bool = True) -> NeoXArgs:
        given = copy.deepcopy(given)
        sources = dict(sources)
        notices = take_foreign_settings(given, sources)
        checked = check_settings(given, sources, GIVEN_BY_CODE)
        sources = {name: sources[name] for name in checked}
        values = {name: copy.deepcopy(setting.default) for name, setting in SETTINGS.items()}
        values.update(checked)
        derive_all(values, sources, require_run_settings, notices, require_model)
        if values["train_batch_size"] is not None and values["lr"] is not None:
            build_deepspeed_config(values)  # its conflicts are config errors too; raise them now
        for name, setting in SETTINGS.items():
            if name not in sources:
                changed = setting.derived or values[name] != setting.default
                sources[name] = DERIVED_SOURCE if changed else DEFAULT_SOURCE
        return cls._create(values, sources, notices, checked, require_run_settings)

    @classmethod
    def _restore(cls, values: dict[str, Any], sources: dict[str, str], notices: list[str],
                 given: dict[str, Any], require_run_settings: bool) -> NeoXArgs:
        """Settings validated by another process (deepy.py hands them to every rank); not checked again."""
        return cls._create({**{n: s.default for n, s in SETTINGS.items()}, **values}, sources, notices, given,
                           require_run_settings)

    @property
    def given(self) -> dict[str, Any]:
        """The values the config files (or dict) gave, before derivation."""
        return copy.deepcopy(self._given)

    @property
    def requires_run_settings(self) -> bool:
        return self._require_run_settings

    def to_dict(self) -> dict[str, Any]:
        return {name: copy.deepcopy(getattr(self, name)) for name in SETTINGS}

    def architecture(self) -> Architecture:
        """The model these settings describe (padded_vocab_size must be set); ModelConfigError if none."""
        return architecture_from_settings({name: getattr(self, name) for name in SETTINGS})

    def lora(self) -> LoraSettings | None:
        """The LoRA adapters these settings ask for; None when lora_rank is 0."""
        return lora_settings({name: getattr(self, name) for name in SETTINGS})

    def source_of(self, name: str) -> str:
        """The config file that set `name`, or "default" / "derived"."""
        if name not in SETTINGS:
            raise KeyError(f"{name!r} is not a setting")
        return self._sources.get(name, DEFAULT_SOURCE)

    def set_by_user(self, name: str) -> bool:
        """Whether a config file (not a default or a derivation) gave `name` its value."""
        return self.source_of(name) not in (DEFAULT_SOURCE, DERIVED_SOURCE)

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
