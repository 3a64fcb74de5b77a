"""The one exception class of the tokenizer area."""

from megatron.errors import ExpectedError


class TokenizerError(ExpectedError, RuntimeError):
    """A tokenizer cannot be built or trained as asked; the message says what, where and what to do."""
