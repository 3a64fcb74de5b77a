"""The language-modelling loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean token cross entropy in fp32.

    ``labels`` [b, s] are the next tokens of the inputs (already shifted, GPT-NeoX's convention);
    with ``loss_mask`` [b, s] the mean runs over the tokens where the mask is 1.
    """
    losses = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    )
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.reshape(-1).float()
    return (losses * mask).sum() / mask.sum()
