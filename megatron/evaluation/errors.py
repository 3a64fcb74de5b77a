from megatron.errors import ExpectedError


class EvaluationError(ExpectedError):
    """An evaluation setting, task or installation eval.py cannot use (the message says which and what to do)."""
