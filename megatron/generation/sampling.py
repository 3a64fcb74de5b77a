"""The next token from the logits, with GPT-NeoX's meaning of temperature, top_k and top_p.

temperature, top_k and top_p all 0 is greedy: the most likely token. Otherwise the logits are divided
by the temperature (when it is above 0), cut to the top_k most likely tokens, then to the smallest set
whose probabilities add up to more than top_p (the most likely token always stays), and one token is
drawn from the softmax of what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0

    @classmethod
    def of(cls, args) -> Sampling:
        return cls(float(args.temperature), int(args.top_k), float(args.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and self.top_k == 0 and self.top_p == 0


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [batch, vocab] -> the chosen token of each row, [batch]."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
    if sampling.top_k > 0:
        kth_largest = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p > 0:
        ordered, order = logits.sort(dim=-1, descending=True)
        # a token stays while the tokens more likely than it add up to at most top_p
        before = F.pad(ordered.softmax(dim=-1).cumsum(dim=-1)[..., :-1], (1, 0))
        ordered = ordered.masked_fill(before > sampling.top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, ordered)
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator).squeeze(-1)
