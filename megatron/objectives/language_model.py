"""train_impl normal: next-token cross entropy over the targets the loss mask trains (pretraining, SFT)."""

from __future__ import annotations

import torch

from megatron.data import BatchOptions, get_batch
from megatron.initialize import current_device
from megatron.model import causal_lm_loss


def forward_loss(engine, samples: dict[str, torch.Tensor], batch_options: BatchOptions | None = None) -> torch.Tensor:
    """The loss of one micro batch: the mean over the targets its loss mask trains."""
    batch = get_batch(samples, batch_options or BatchOptions()).to(current_device())
    logits = engine(batch.tokens, position_ids=batch.position_ids, attention_mask=batch.attention_mask,
                    parallel_output=True)
    return causal_lm_loss(logits, batch.labels, batch.loss_mask, vocab_parallel=True)


class LanguageModelLoss:
    metric_names: tuple[str, ...] = ()
    reports_perplexity = True

    def __init__(self, batch_options: BatchOptions):
        self.batch_options = batch_options

    def __call__(self, engine, samples):
        return forward_loss(engine, samples, self.batch_options), {}
