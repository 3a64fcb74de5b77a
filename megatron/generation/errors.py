from megatron.errors import ExpectedError


class GenerationError(ExpectedError):
    """A generation setting or input file generate.py cannot use (the message says which and what to do)."""
