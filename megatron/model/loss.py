"""The language-modelling loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.model.context_parallel import ContextParallelSplit, whole_sequence_loss
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
    context_parallel: bool = False,
) -> torch.Tensor:
    """Mean token cross entropy in fp32.

    ``labels`` [b, s] are the next tokens of the inputs (already shifted, GPT-NeoX's convention);
    with ``loss_mask`` [b, s] the mean runs over the tokens where the mask is 1. With
    ``vocab_parallel`` the logits are this tensor-parallel rank's vocabulary slice
    (``GPTModel(..., parallel_output=True)``) and megatron-core's vocab-parallel cross entropy
    computes the loss; it overwrites fp32 logits in place. With ``context_parallel`` the logits are this
    context-parallel rank's tokens (GPTModel), the labels and mask the whole sequence's, and the mean runs over
    the whole sequence (megatron/model/context_parallel.py, ``whole_sequence_loss``).
    """
    mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
    if context_parallel:
        share = ContextParallelSplit.of_this_rank(labels.shape[1], labels.device)
        labels, mask = share.own(labels), share.own(mask)
    if vocab_parallel and tensor_parallel_size() > 1:
        losses = vocab_parallel_cross_entropy(logits.float(), labels).reshape(-1)
    else:
        losses = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        )
    mask = mask.reshape(-1)
    if context_parallel:
        return whole_sequence_loss((losses * mask).sum(), mask.sum())
    if loss_mask is None:
        return losses.mean()
    # A micro batch with nothing to train (every label masked) contributes 0, not 0 / 0.
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
