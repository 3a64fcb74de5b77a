"""NeoXArgs: the validated settings of one run, read as attributes (``args.hidden_size``)."""

from __future__ import annotations

import copy
from typing import Any

from megatron.neox_arguments.schema import SETTINGS


class NeoXArgs:
    """Every setting of the schema as an attribute; unset ones hold their default."""

    def __init__(self, values: dict[str, Any]):
        for name, setting in SETTINGS.items():
            object.__setattr__(self, name, copy.deepcopy(setting.default))
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> NeoXArgs:
        return cls(dict(values))

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SETTINGS}

    def __repr__(self) -> str:
        return f"NeoXArgs({self.to_dict()!r})"
