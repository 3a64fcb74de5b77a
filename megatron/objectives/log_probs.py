"""Per-token log-probabilities of a batch's targets under the policy and under the frozen reference, the
quantities DPO and KTO compare (one home for both)."""

from __future__ import annotations

import torch

from megatron.data import Batch
from megatron.model import token_log_probs
from megatron.model.context_parallel import ContextParallelSplit, whole_sequence_values
from megatron.ranks import context_parallel_rank_and_size


def target_log_probs(model, batch: Batch, fp32: bool) -> torch.Tensor:
    """log p(target) at every position [b, s], 0 where the loss mask is 0, from `model`'s vocabulary slices."""
    logits = model(batch.tokens, position_ids=batch.position_ids, attention_mask=batch.attention_mask,
                   parallel_output=True)
    if context_parallel_rank_and_size()[1] == 1:
        return token_log_probs(logits, batch.labels, vocab_parallel=True, fp32=fp32) * batch.loss_mask
    # the logits are this context-parallel rank's tokens' (GPTModel): every rank gets the whole sequence's values
    share = ContextParallelSplit.of_this_rank(batch.labels.shape[1], batch.labels.device)
    own = token_log_probs(logits, share.own(batch.labels), vocab_parallel=True, fp32=fp32) * share.own(batch.loss_mask)
    return whole_sequence_values(own, share)


def reference_log_probs(reference, batch: Batch, fp32: bool, precomputed: torch.Tensor | None) -> torch.Tensor:
    """The reference's `target_log_probs`: read from `precomputed` (GPT-NeoX's precompute_model_name files,
    entry j the log-probability of token j+1, as long as the inputs) or computed by the frozen `reference`."""
    if precomputed is not None:
        return precomputed.to(batch.loss_mask.device).float()[:, :batch.tokens.shape[1]] * batch.loss_mask
    with torch.no_grad():
        return target_log_probs(reference, batch, fp32).float()
