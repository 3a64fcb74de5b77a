"""Numbers in settings, whatever PyYAML made of them: one rule, and the nested sections that hold them.

PyYAML reads YAML 1.1, where a float needs a dot and a signed exponent: `1e-4`, `5e8` and even
`1.0e8` stay strings. YAML 1.2 and Python read them as numbers, and GPT-NeoX configs are full of
them. So a string spelling a number in that syntax is that number, a whole float (`5e8`) is an
integer where an integer is wanted, and anything else where a number is wanted is an error naming
the file and the dotted key path.

The nested sections: optimizer.params (torch's and DeepSpeed's optimizer arguments, with their
ranges here) and the DeepSpeed sections zero_optimization, fp16 and bf16 (also as
deepspeed_extra_args adds to them), whose numeric keys and ranges are DeepSpeed's own config models'.
"""

from __future__ import annotations

import enum
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.neox_arguments.errors import ConfigError

_NUMBER_TEXT = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def as_number(value: Any, kind: type) -> int | float | None:
    """`value` as a number of `kind` (int or float); None when it is not one (a bool never is)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        if not _NUMBER_TEXT.fullmatch(text):
            return None
        value = int(text) if text.lstrip("+-").isdigit() else float(text)  # int(): exact beyond 2**53
    if not isinstance(value, int | float):
        return None
    if kind is int:
        return int(value) if isinstance(value, int) or value.is_integer() else None
    return value


# torch, numpy and DeepSpeed count iterations, samples and sizes in signed 64-bit integers
INT64_MAX = 2**63 - 1


def check_numbers_usable(location: str, value: Any) -> None:
    """NaN or infinity anywhere in a setting, nested sections and lists included, is an error; so is a whole
    number no 64-bit integer holds (the run would die on it in a traceback, or allocate what no machine has)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{location}: {value} is not a finite number; give a finite value")
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigError(f"{location}: {value} is beyond the 64-bit integers torch and numpy count in "
                          f"(at most {INT64_MAX}); give a smaller value")
    if isinstance(value, dict):
        for key, item in value.items():
            check_numbers_usable(f"{location}.{key}", item)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_numbers_usable(f"{location}[{index}]", item)


@dataclass(frozen=True)
class NumberRule:
    kind: type  # int or float
    allowed: Callable[[float], bool] = lambda _: True
    requirement: str = ""  # what `allowed` asks, for the error: "must be in [0, 1)"
    count: int | None = None  # a list of this many numbers (Adam's betas), not one


def _in_unit_interval(x: float) -> bool:
    return 0 <= x < 1


# The numeric arguments of the optimizers DeepSpeed builds from optimizer.params (torch's and
# DeepSpeed's Adam, AdamW and SGD). lr's range is checked once it is merged with the top-level lr.
OPTIMIZER_PARAMS = {
    "lr": NumberRule(float),
    "betas": NumberRule(float, _in_unit_interval, "must each be in [0, 1)", count=2),
    "eps": NumberRule(float, lambda x: x > 0, "must be positive"),
    "weight_decay": NumberRule(float, lambda x: x >= 0, "must not be negative"),
    "momentum": NumberRule(float, _in_unit_interval, "must be in [0, 1)"),
    "dampening": NumberRule(float, lambda x: 0 <= x <= 1, "must be in [0, 1]"),
}


def _number_kind(annotation: Any) -> type | None:
    """int or float for an annotation that is one (Optional included, an integer enum as int)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = {_number_kind(arg) for arg in typing.get_args(annotation) if arg is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    if isinstance(annotation, type) and issubclass(annotation, int) and issubclass(annotation, enum.Enum):
        return int
    return annotation if annotation in (int, float) else None


def _nested_model(annotation: Any) -> type | None:
    from pydantic import BaseModel

    candidates = typing.get_args(annotation) if typing.get_origin(annotation) else (annotation,)
    models = [arg for arg in candidates if isinstance(arg, type) and issubclass(arg, BaseModel)]
    return models[0] if len(models) == 1 else None


def _model_number_keys(model) -> dict[str, Any]:
    """Each key of a DeepSpeed config model (names and aliases) that holds a number: its kind, or the
    same map of a nested section (offload_param, offload_optimizer)."""
    keys: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        kind = _number_kind(field.annotation)
        nested = None if kind else _nested_model(field.annotation)
        found = NumberRule(kind) if kind else (_model_number_keys(nested) if nested else None)
        if found:
            keys.update(dict.fromkeys({name, field.alias or name}, found))
    return keys


@functools.cache
def deepspeed_sections() -> dict[str, Any]:
    """The DeepSpeed config model of each DeepSpeed section a config may hold."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config}


@functools.cache
def _section_rules() -> dict[str, dict[str, Any]]:
    sections = {name: _model_number_keys(model) for name, model in deepspeed_sections().items()}
    # deepspeed_extra_args may add keys to these sections; they reach DeepSpeed the same way
    return {"optimizer": {"params": OPTIMIZER_PARAMS}, **sections, "deepspeed_extra_args": sections}


def read_section_numbers(name: str, section: Any, location: str) -> Any:
    """A copy of setting `name`'s section with each number read by the one rule; ConfigError naming
    `location` and the key path for what is not a number or outside its range."""
    rules = _section_rules().get(name)
    if rules is None or not isinstance(section, dict):
        return section
    return _read(section, rules, location)


def _read(section: dict, rules: dict[str, Any], location: str) -> dict:
    read = dict(section)
    for key, value in section.items():
        rule = rules.get(key)
        if rule is None or value is None:
            continue
        here = f"{location}.{key}"
        if isinstance(rule, dict):
            read[key] = _read(value, rule, here) if isinstance(value, dict) else value
        elif rule.count is not None:
            read[key] = _read_list(value, rule, here)
        else:
            read[key] = _read_one(value, rule, here)
    return read


def _read_one(value: Any, rule: NumberRule, location: str) -> int | float:
    number = as_number(value, rule.kind)
    if number is None:
        wanted = "a whole number" if rule.kind is int else "a number"
        raise ConfigError(f"{location}: {value!r} is not {wanted}")
    check_numbers_usable(location, number)
    if not rule.allowed(number):
        raise ConfigError(f"{location}: {rule.requirement}, got {number}")
    return number


def _read_list(value: Any, rule: NumberRule, location: str) -> list:
    if not isinstance(value, list | tuple) or len(value) != rule.count:
        raise ConfigError(f"{location}: expected a list of {rule.count} numbers, got {value!r}")
    numbers = [_read_one(item, NumberRule(rule.kind), f"{location}[{index}]") for index, item in enumerate(value)]
    if not all(rule.allowed(number) for number in numbers):
        raise ConfigError(f"{location}: {rule.requirement}, got {numbers}")
    return numbers
