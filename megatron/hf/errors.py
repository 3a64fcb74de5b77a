"""The one exception class of the Hugging Face interop area."""

from megatron.checkpointing import CheckpointError


class HFConversionError(CheckpointError):
    """A Hugging Face model cannot be converted or loaded as asked.

    A CheckpointError, so the load plan treats an unusable HF directory like any other unusable checkpoint.
    """
