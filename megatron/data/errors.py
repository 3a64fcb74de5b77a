"""The one exception class of the data area."""

from megatron.errors import ExpectedError


class DataError(ExpectedError, RuntimeError):
    """A dataset cannot be read, written or sampled as asked; the message says what, where and what to do."""
