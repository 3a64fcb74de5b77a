"""The one exception class of the model area."""


class ModelConfigError(ValueError):
    """The settings do not describe a model that can be built; the message says which and how to fix it."""
