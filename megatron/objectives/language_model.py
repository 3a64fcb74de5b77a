"""train_impl normal: next-token cross entropy over the targets the loss mask trains (pretraining, SFT).

With experts and ``moe_load_balancing_loss`` the loss is Hugging Face's for a mixture of experts: the cross
entropy plus ``moe_load_balancing_loss_coef`` x the load-balancing loss over every token of the micro batch
(transformers' load_balancing_loss_func without an attention mask), both reported on their own. With experts
the load-balancing loss is reported in any case, and every expert's load (megatron/objectives/expert_load.py).
"""

from __future__ import annotations

import torch

from megatron.contract.architecture import Architecture
from megatron.data import BatchOptions, get_batch
from megatron.model import causal_lm_loss, expert_load, load_balancing_loss
from megatron.model.moe import Routing
from megatron.objectives.expert_load import expert_load_metrics
from megatron.runtime.initialize import current_device


def forward_loss(engine, samples: dict[str, torch.Tensor], batch_options: BatchOptions | None = None,
                 routing: list[Routing] | None = None, context_parallel: bool = False) -> torch.Tensor:
    """The loss of one micro batch: the mean over the targets its loss mask trains. With ``routing``
    (a list) the expert layers append what their routers did to it. With ``context_parallel`` this rank computes
    its share of every sequence (megatron/model/context_parallel.py)."""
    batch = get_batch(samples, batch_options or BatchOptions()).to(current_device())
    logits = engine(batch.tokens, position_ids=batch.position_ids, attention_mask=batch.attention_mask,
                    parallel_output=True, routing=routing)
    return causal_lm_loss(logits, batch.labels, batch.loss_mask, vocab_parallel=True,
                          context_parallel=context_parallel)


class LanguageModelLoss:
    def __init__(self, batch_options: BatchOptions, arch: Architecture | None = None):
        self.batch_options = batch_options
        self.context_parallel = arch is not None and arch.context_parallel_size > 1
        self.experts = arch if arch is not None and arch.moe else None
        self.balanced = self.experts is not None and self.experts.moe_load_balancing_loss
        self.metric_names: tuple[str, ...] = (("lm_loss", "load_balancing_loss") if self.balanced else
                                              ("load_balancing_loss",) if self.experts else ())
        self.reports_perplexity = not self.balanced  # exp(loss) is a perplexity only without the added loss

    def __call__(self, engine, samples):
        if self.experts is None:
            return forward_loss(engine, samples, self.batch_options, context_parallel=self.context_parallel), {}
        routing: list[Routing] = []
        lm_loss = forward_loss(engine, samples, self.batch_options, routing)
        balance = load_balancing_loss([record.logits for record in routing], self.experts.moe_num_experts,
                                      self.experts.moe_top_k)
        return self.with_experts(lm_loss, balance,
                                 [expert_load(record.chosen, self.experts.moe_num_experts) for record in routing])

    def with_experts(self, lm_loss: torch.Tensor, balance: torch.Tensor,
                     loads: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metrics of a micro batch from its language-model loss, load-balancing loss and every
        expert layer's load (also of a pipeline's, megatron/training/pipe_engine.py)."""
        metrics = {"load_balancing_loss": balance.detach(), **expert_load_metrics(self.experts, loads)}
        if not self.balanced:
            return lm_loss, metrics
        return lm_loss + self.experts.moe_load_balancing_loss_coef * balance, {"lm_loss": lm_loss.detach(), **metrics}
