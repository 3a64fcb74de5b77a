"""The one exception class of the checkpointing area."""

from megatron.errors import ExpectedError


class CheckpointError(ExpectedError, RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; the message says what, where and what to do."""
