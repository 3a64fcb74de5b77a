"""Checks of each setting on its own: known name, not derived, right type, allowed value."""

from __future__ import annotations

import difflib
from typing import Any

from megatron.neox_arguments.errors import ConfigError, where
from megatron.neox_arguments.foreign import gpt_neox_only_value
from megatron.neox_arguments.numbers import as_number, check_numbers_usable, read_section_numbers
from megatron.neox_arguments.schema import SETTINGS, Setting


def _allowed_types(setting: Setting) -> tuple[type, ...]:
    return setting.type if isinstance(setting.type, tuple) else (setting.type,)


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def coerce_value(setting: Setting, value: Any) -> Any:
    """The value converted to the setting's type where that is unambiguous; None when it cannot be."""
    types = _allowed_types(setting)
    if isinstance(value, bool):
        return value if bool in types else None
    if isinstance(value, types):
        return value
    for kind in (float, int):
        if kind in types:
            return as_number(value, kind)
    return None


def check_setting(name: str, value: Any, sources: dict[str, str], allowed_derived: tuple[str, ...] = ()) -> Any:
    """The value, type-converted, after checking it is a known, user-settable, allowed value."""
    setting = SETTINGS.get(name)
    if setting is None:
        close = difflib.get_close_matches(name, list(SETTINGS), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else "; see megatron/neox_arguments/schema.py for every setting"
        raise ConfigError(f"{where(sources, name)}: unknown setting{hint}")
    if setting.derived and name not in allowed_derived:
        raise ConfigError(
            f"{where(sources, name)}: is derived ({setting.doc}) and cannot be set in a config; remove it"
        )
    converted = coerce_value(setting, value)
    if converted is None and value is not None:
        raise ConfigError(
            f"{where(sources, name)}: expected {_type_names(_allowed_types(setting))}, got {value!r} "
            f"({type(value).__name__})"
        )
    if converted is None and type(None) not in _allowed_types(setting):
        raise ConfigError(f"{where(sources, name)}: must not be null (expected {_type_names(_allowed_types(setting))})")
    converted = read_section_numbers(name, converted, where(sources, name))
    check_numbers_usable(where(sources, name), converted)
    if setting.choices is not None and converted not in setting.choices:
        feature = gpt_neox_only_value(name, converted)
        if feature is not None:
            raise ConfigError(f"{where(sources, name)}: {converted!r}: {feature} is a GPT-NeoX feature not built here")
        allowed = ", ".join(repr(c) for c in setting.choices if c is not None)
        raise ConfigError(f"{where(sources, name)}: {converted!r} is not one of {allowed}")
    return converted


def check_settings(values: dict[str, Any], sources: dict[str, str],
                   allowed_derived: tuple[str, ...] = ()) -> dict[str, Any]:
    return {name: check_setting(name, value, sources, allowed_derived) for name, value in values.items()}
