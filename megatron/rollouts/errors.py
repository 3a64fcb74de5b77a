from megatron.errors import ExpectedError


class RolloutError(ExpectedError):
    """A reward function, prompt or data-server reply REINFORCE cannot use (the message says which and what to do)."""
