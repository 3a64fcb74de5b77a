"""`reward_model`: a completion's reward is the reward model's scalar for prompt + completion, read where a
train_impl rm run reads it (objectives/reward_model.py): --for-rm chats end with two end-of-text tokens and the
value is taken at the first, so here at the end-of-text token after the completion (the completion's own when it
finished, else one appended). All completions of a micro batch are scored in one forward (right-padded: the
model is causal, so the padding changes no value before it), on every rank of the tensor-parallel group."""

from __future__ import annotations

import torch


def scored_sequences(prompt_ids: list[list[int]], completion_ids: list[list[int]], eod: int) -> list[list[int]]:
    """Each prompt + completion ending at its end-of-text token, whose value is the reward."""
    return [prompt + completion + ([] if completion and completion[-1] == eod else [eod])
            for prompt, completion in zip(prompt_ids, completion_ids, strict=True)]


class RewardModelScores:
    def __init__(self, engine, eod: int):
        self.engine = engine  # a frozen forward-only engine of a model with the reward head (eval mode)
        self.eod = eod

    @torch.no_grad()
    def __call__(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], **texts) -> list[float]:
        sequences = scored_sequences(prompt_ids, completion_ids, self.eod)
        width = max(map(len, sequences))
        device = next(self.engine.module.parameters()).device
        tokens = torch.tensor([row + [self.eod] * (width - len(row)) for row in sequences], device=device)
        values = self.engine(tokens).reshape(len(sequences), width).float()
        ends = torch.tensor([len(row) - 1 for row in sequences], device=device)
        return values.gather(1, ends[:, None])[:, 0].tolist()
