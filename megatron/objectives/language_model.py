"""train_impl normal: next-token cross entropy over the targets the loss mask trains (pretraining, SFT).

With experts and ``moe_load_balancing_loss`` the loss is Hugging Face's for a mixture of experts: the cross
entropy plus ``moe_load_balancing_loss_coef`` x the load-balancing loss over every token of the micro batch
(transformers' load_balancing_loss_func without an attention mask), both reported on their own.
"""

from __future__ import annotations

import torch

from megatron.architecture import Architecture
from megatron.data import BatchOptions, get_batch
from megatron.initialize import current_device
from megatron.model import causal_lm_loss, load_balancing_loss


def forward_loss(engine, samples: dict[str, torch.Tensor], batch_options: BatchOptions | None = None,
                 router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The loss of one micro batch: the mean over the targets its loss mask trains. With ``router_logits``
    (a list) the expert layers append their routers' logits to it."""
    batch = get_batch(samples, batch_options or BatchOptions()).to(current_device())
    logits = engine(batch.tokens, position_ids=batch.position_ids, attention_mask=batch.attention_mask,
                    parallel_output=True, router_logits=router_logits)
    return causal_lm_loss(logits, batch.labels, batch.loss_mask, vocab_parallel=True)


class LanguageModelLoss:
    def __init__(self, batch_options: BatchOptions, arch: Architecture | None = None):
        self.batch_options = batch_options
        self.balanced = arch if arch is not None and arch.moe and arch.moe_load_balancing_loss else None
        self.metric_names: tuple[str, ...] = ("lm_loss", "load_balancing_loss") if self.balanced else ()
        self.reports_perplexity = self.balanced is None  # exp(loss) is a perplexity only without the added loss

    def __call__(self, engine, samples):
        if self.balanced is None:
            return forward_loss(engine, samples, self.batch_options), {}
        router_logits: list[torch.Tensor] = []
        lm_loss = forward_loss(engine, samples, self.batch_options, router_logits)
        balance = load_balancing_loss(router_logits, self.balanced.moe_num_experts, self.balanced.moe_top_k)
        loss = lm_loss + self.balanced.moe_load_balancing_loss_coef * balance
        return loss, {"lm_loss": lm_loss.detach(), "load_balancing_loss": balance.detach()}
