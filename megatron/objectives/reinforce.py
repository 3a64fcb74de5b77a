"""train_impl reinforce: GPT-NeoX's REINFORCE loss, with its normalisation, on scored completions.

Samples (megatron/rollouts: sampled here, or from GPT-NeoX's data server): `text` [b, s+1] (prompt, then
completion, then padding), `label` (the completion's tokens, negative elsewhere), `reward` [b, 1], the
completion's advantage (GPT-NeoX's name for it), and `raw_reward` [b, 1], its reward before any baseline.

With lp and rp the policy's and the reference's log-probabilities of each target token, m the loss mask, A the
advantage and k the KL penalty of kl_impl (abs |lp - rp|, mse (lp - rp)^2 / 2, kl lp - rp, full: the KL of the
policy's next-token distribution from the reference's over the whole vocabulary):

    l[i, t] = -lp[i, t] * A[i] + kl_div_beta * k[i, t]        (no k term when kl_div_beta is 0: no reference)
    loss    = mean_i( sum_t l[i, t] m[i, t] / N ),  N = sum_{i, t} m[i, t] (the micro batch's trained tokens)

so the token mean is divided by the micro batch's sample count once more, as GPT-NeoX computes it: a GPT-NeoX
recipe's learning rate means the same here. Metrics, as GPT-NeoX reports them: ref_logp, logp and kl are means
over every position of the micro batch (prompt and padding included, not only the trained tokens), reward the
mean raw reward, reward_std its unbiased std over the micro batch (NaN for a single sample).
Log-probabilities come from the vocabulary-parallel cross entropy on each rank's slice (GPT-NeoX's helper for
it is missing from its current code); kl_impl full gathers the vocabulary (differentiably) first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.data import BatchOptions, get_batch
from megatron.model import token_log_probs
from megatron.runtime.initialize import current_device


def kl_penalty(kind: str, lp: torch.Tensor, rp: torch.Tensor, full: tuple[torch.Tensor, torch.Tensor] | None):
    """GPT-NeoX's per-token penalty k [b, s]; `full` holds the whole-vocabulary log-probabilities for kl_impl full."""
    if kind == "abs":
        return (lp - rp).abs()
    if kind == "mse":
        return 0.5 * (lp - rp) ** 2
    if kind == "kl":
        return lp - rp
    policy, reference = full
    return (policy.exp() * (policy - reference)).sum(dim=-1)


class Reinforce:
    reports_perplexity = False

    def __init__(self, batch_options: BatchOptions, kl_impl: str, kl_div_beta: float, fp32: bool, reference=None):
        self.batch_options = batch_options
        self.kl_impl = kl_impl
        self.beta = kl_div_beta
        self.fp32 = fp32
        self.reference = reference if kl_div_beta > 0 else None
        self.metric_names = (("ref_logp",) if self.reference is not None else ()) + ("logp", "reward", "reward_std") \
            + (("kl",) if self.reference is not None else ())

    def _log_probs(self, model, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(lp [b, s] at every position, the whole vocabulary's log-probabilities [b, s, V] for kl_impl full)."""
        logits = model(batch.tokens, position_ids=batch.position_ids, attention_mask=batch.attention_mask,
                       parallel_output=self.kl_impl != "full")
        if self.kl_impl != "full":
            return token_log_probs(logits, batch.labels, vocab_parallel=True, fp32=self.fp32), None
        full = F.log_softmax(logits.float() if self.fp32 else logits, dim=-1)
        return full.gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1), full

    def __call__(self, engine, samples):
        batch = get_batch({"text": samples["text"], "label": samples["label"]}, self.batch_options).to(current_device())
        advantage = samples["reward"].to(batch.loss_mask.device).float().reshape(-1, 1)
        raw_reward = samples["raw_reward"].to(batch.loss_mask.device).float().reshape(-1)
        lp, policy_full = self._log_probs(engine, batch)
        per_token = -lp * advantage
        metrics = {}
        if self.reference is not None:
            with torch.no_grad():
                rp, reference_full = self._log_probs(self.reference, batch)
            penalty = kl_penalty(self.kl_impl, lp, rp, (policy_full, reference_full))
            per_token = per_token + self.beta * penalty
            metrics["ref_logp"] = rp.detach().float().mean()
        trained = batch.loss_mask.sum()
        loss = ((per_token * batch.loss_mask).sum(dim=1) / trained).mean()
        metrics.update(logp=lp.detach().float().mean(), reward=raw_reward.mean(), reward_std=raw_reward.std())
        if self.reference is not None:
            metrics["kl"] = penalty.detach().float().mean()
        return loss, metrics
