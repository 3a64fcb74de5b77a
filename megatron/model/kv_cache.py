"""The keys and values of the tokens a model has already run, kept for generating one token at a time.

Each layer's attention appends the keys and values of the tokens it is given to its entry and attends
over all of them, so a step after the first runs only the newest token through the model. Entries
hold this tensor-parallel rank's key/value heads, [batch, kv_heads, tokens, head_dim].
"""

from __future__ import annotations

import torch


class LayerKeysValues:
    """One layer's cached keys and values."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' keys and values; returns those of every token so far."""
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat((self.keys, keys), dim=2)
            self.values = torch.cat((self.values, values), dim=2)
        return self.keys, self.values


class KVCache:
    """Every layer's cached keys and values; pass the same one to each forward of one generation."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerKeysValues() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Tokens already run (their positions are 0 .. length - 1)."""
        return self.layers[0].length if self.layers else 0
