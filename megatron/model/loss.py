"""The language-modelling loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.ranks import tensor_parallel_size


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, vocab_parallel: bool = False,
                    fp32: bool = True) -> torch.Tensor:
    """log p(label) at every position [b, s], from logits [b, s, V] (or this rank's vocabulary slice).

    With ``vocab_parallel`` at tensor-parallel size > 1, megatron-core's vocab-parallel cross entropy
    computes it from the slices (never from gathered logits, whose backward it would get wrong);
    ``fp32`` casts the logits first (GPT-NeoX's dpo_fp32 / kto_fp32). The vocab-parallel path overwrites
    fp32 logits in place: read nothing else from them afterwards.
    """
    logits = logits.float() if fp32 else logits
    if vocab_parallel and tensor_parallel_size() > 1:
        return -vocab_parallel_cross_entropy(logits, labels)
    return -F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                            reduction="none").reshape(labels.shape)


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    vocab_parallel: bool = False,
) -> torch.Tensor:
    """Mean token cross entropy in fp32.

    ``labels`` [b, s] are the next tokens of the inputs (already shifted, GPT-NeoX's convention);
    with ``loss_mask`` [b, s] the mean runs over the tokens where the mask is 1. With
    ``vocab_parallel`` the logits are this tensor-parallel rank's vocabulary slice
    (``GPTModel(..., parallel_output=True)``) and megatron-core's vocab-parallel cross entropy
    computes the loss; it overwrites fp32 logits in place.
    """
    if vocab_parallel and tensor_parallel_size() > 1:
        losses = vocab_parallel_cross_entropy(logits.float(), labels).reshape(-1)
    else:
        losses = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        )
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.reshape(-1).float()
    # A micro batch with nothing to train (every label masked) contributes 0, not 0 / 0.
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
