"""The one exception class of the checkpointing area."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; the message says what, where and what to do."""
