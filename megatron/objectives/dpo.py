"""train_impl dpo: Direct Preference Optimization (Rafailov et al. 2023) as GPT-NeoX defines it.

Samples (the pairwise dataset): `pos`, `neg` [b, s+1] tokens of the chosen and rejected answers, their
label files `pos_label`, `neg_label` (aligned with the tokens, negative where not trained), and, with
`precompute_model_name`, the reference's log-probabilities `pos_ref`, `neg_ref` [b, s].

Each answer's log-probability is the sum (not the mean) of its trained targets' log-probabilities; with
the implicit rewards r = beta * (log pi - log pi_ref) the loss is mean(-log sigmoid(r_chosen - r_rejected)).
`dpo_reference_free` takes log pi_ref = 0. Metrics (GPT-NeoX's names): chosen_rewards and
rejected_rewards (means of r), reward_acc (the fraction of pairs with r_chosen > r_rejected, strictly),
margins (mean of r_chosen - r_rejected).

Packed pairs (pack_until_overflow, whose rows carry their documents' segments): document k of a chosen row
pairs with document k of its rejected row, each answer's sum is over its own document, and the means run
over the micro batch's pairs, so a micro batch scores as the same pairs unpacked would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.data import BatchOptions, document_sums, pairwise_batch
from megatron.objectives.log_probs import reference_log_probs, target_log_probs
from megatron.runtime.initialize import current_device


class DirectPreferenceOptimization:
    metric_names: tuple[str, ...] = ("chosen_rewards", "rejected_rewards", "reward_acc", "margins")
    reports_perplexity = False

    def __init__(self, batch_options: BatchOptions, beta: float, fp32: bool, reference=None,
                 reference_free: bool = False):
        self.batch_options = batch_options
        self.beta = beta
        self.fp32 = fp32
        self.reference = reference  # the frozen model; None when reference-free or precomputed
        self.reference_free = reference_free

    def __call__(self, engine, samples):
        # chosen and rejected in one forward, split back by halves (GPT-NeoX's layout)
        batch = pairwise_batch(samples, self.batch_options).to(current_device())
        policy, present = document_sums(target_log_probs(engine, batch, self.fp32), batch)
        policy = policy.float()  # summed in the log-probabilities' own dtype, as unpacked rows always were
        if self.reference_free:
            reference = torch.zeros_like(policy)
        else:
            precomputed = torch.cat([samples["pos_ref"], samples["neg_ref"]]) if "pos_ref" in samples else None
            reference = document_sums(reference_log_probs(self.reference, batch, self.fp32, precomputed), batch)[0]
        pairs = torch.logical_and(*present.chunk(2))
        rewards = self.beta * (policy - reference).detach()
        chosen_rewards, rejected_rewards = (side[pairs] for side in rewards.chunk(2))
        policy_chosen, policy_rejected = (side[pairs] for side in policy.chunk(2))
        reference_chosen, reference_rejected = (side[pairs] for side in reference.chunk(2))
        logits = self.beta * ((policy_chosen - policy_rejected) - (reference_chosen - reference_rejected))
        loss = -F.logsigmoid(logits).mean()
        return loss, {"chosen_rewards": chosen_rewards.mean(), "rejected_rewards": rejected_rewards.mean(),
                      "reward_acc": (chosen_rewards > rejected_rewards).float().mean(),
                      "margins": (chosen_rewards - rejected_rewards).mean()}
