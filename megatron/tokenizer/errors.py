"""The one exception class of the tokenizer area."""


class TokenizerError(RuntimeError):
    """A tokenizer cannot be built or trained as asked; the message says what, where and what to do."""
