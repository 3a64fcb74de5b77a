"""Settings: the schema, YAML loading and merging, validation, derived values, DeepSpeed config."""

from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.schema import SETTINGS, Setting

__all__ = ["NeoXArgs", "SETTINGS", "Setting"]
