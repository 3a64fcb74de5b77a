"""Settings: the schema, YAML loading and merging, validation, derived values, DeepSpeed config."""

from megatron.neox_arguments.arguments import NeoXArgs
from megatron.neox_arguments.derived import padded_vocab_size
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.handover import load_args_on_rank
from megatron.neox_arguments.schema import SETTINGS, Setting

__all__ = ["ConfigError", "NeoXArgs", "SETTINGS", "Setting", "load_args_on_rank", "padded_vocab_size"]
