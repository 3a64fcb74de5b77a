"""Scored completions as the REINFORCE objective reads them, GPT-NeoX's online samples: `text` is prompt +
completion padded with 0 to seq_length + 1, `label` the completion's tokens where they are (-100 elsewhere), `reward`
[n, 1] the advantage, `raw_reward` [n, 1] the reward. A prompt + completion longer than seq_length + 1 (only a
data server sends one) loses its end, where GPT-NeoX's batch would fail."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASKED = -100


@dataclass(frozen=True)
class ScoredCompletion:
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float
    advantage: float


def prompt_of(text: torch.Tensor, label: torch.Tensor) -> list[int] | None:
    """The tokens of a chat sample before its first trained label (None when nothing of it is trained)."""
    trained = (label >= 0).nonzero()
    return None if trained.numel() == 0 else text[: int(trained[0])].tolist()


def samples_of(rows: list[ScoredCompletion], seq_length: int) -> dict[str, torch.Tensor]:
    width = seq_length + 1
    text = torch.zeros(len(rows), width, dtype=torch.long)
    label = torch.full((len(rows), width), MASKED, dtype=torch.long)
    for index, row in enumerate(rows):
        tokens = (row.prompt_ids + row.completion_ids)[:width]
        text[index, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        end = len(tokens)
        label[index, len(row.prompt_ids):end] = text[index, len(row.prompt_ids):end]
    return {"text": text, "label": label,
            "reward": torch.tensor([[row.advantage] for row in rows], dtype=torch.float32),
            "raw_reward": torch.tensor([[row.reward] for row in rows], dtype=torch.float32)}
