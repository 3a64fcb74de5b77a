"""The one exception class of the model area."""

from megatron.errors import ExpectedError


class ModelConfigError(ExpectedError, ValueError):
    """The settings do not describe a model that can be built; the message says which and how to fix it."""
