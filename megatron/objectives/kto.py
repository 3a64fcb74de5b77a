"""train_impl kto: Kahneman-Tversky Optimization (Ethayarajh et al. 2024) on GPT-NeoX's data and settings.

Samples (the gpt2 dataset with reward files): `text` [b, s+1], `label` (aligned, negative where not
trained) and `reward`, the sample's reward (one value per sample, or repeated over its tokens as GPT-NeoX's
reward files give it): above 0 a desirable answer, below 0 an undesirable one, 0 an unweighted one.
With `precompute_model_name`, `ref` [b, s] holds the reference's log-probabilities.

For sample i, l_i = sum over its trained targets of (log pi - log pi_ref), and the loss is
mean_i w_i * (1 - sigmoid(beta * sign(r_i) * (l_i - z))), w_i = kto_desirable_weight or
kto_undesirable_weight by the sign of r_i. z, the KL reference point, is GPT-NeoX's estimate: the micro
batch is split in two halves and each half's z is the mean over the other half of max(l_j, 0), not
differentiated. (The paper's estimate needs an extra forward over mismatched prompt/answer pairs, which
samples that hold prompt and answer in one sequence do not separate.) Unlike GPT-NeoX, the reward's sign
scales beta, not its mean over the whole padded sequence, and the class weights apply per sample, so a
sample's gradient does not depend on the sequence length or on its half's other samples.

Log-probabilities come from the vocabulary-parallel cross entropy on each rank's slice (GPT-NeoX applies
it to gathered logits, which gets the gradients wrong under tensor parallelism).
Metrics: kl (sum of log pi - log pi_ref over all trained targets / their number), reward_acc (the fraction
of samples whose beta * sign(r) * l is above 0).

Packed rows (pack_until_overflow, with the dataset's segments): each document is a sample, taken row by row
in its order within the row, so a micro batch scores (halves, means) as those documents unpacked would.
"""

from __future__ import annotations

import torch

from megatron.data import Batch, BatchOptions, document_sums, get_batch
from megatron.objectives.log_probs import reference_log_probs, target_log_probs
from megatron.runtime.initialize import current_device

_NEUTRAL = 1e-3  # |reward| at most this: neither desirable nor undesirable (GPT-NeoX's threshold)


def sample_rewards(reward: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """One reward per sample [b]: as given, or the mean over the trained targets of a per-token reward."""
    if reward.dim() == 1 or reward.shape[1] == 1:
        return reward.reshape(-1).float()
    per_target = reward[:, 1:loss_mask.shape[1] + 1].float()
    return (per_target * loss_mask).sum(dim=1) / loss_mask.sum(dim=1).clamp(min=1.0)


def document_log_ratios_and_rewards(ratios: torch.Tensor, reward: torch.Tensor, batch: Batch):
    """Packed rows: each document's summed log-ratio and its reward (the mean over its trained targets), [n]
    both, the documents row by row."""
    log_ratio, present = document_sums(ratios, batch)
    trained = document_sums(batch.loss_mask, batch)[0]
    rewarded = document_sums(reward[:, 1:batch.loss_mask.shape[1] + 1].float() * batch.loss_mask, batch)[0]
    return log_ratio[present], (rewarded / trained.clamp(min=1.0))[present]


class KahnemanTverskyOptimization:
    metric_names: tuple[str, ...] = ("kl", "reward_acc")
    reports_perplexity = False

    def __init__(self, batch_options: BatchOptions, beta: float, fp32: bool, desirable_weight: float,
                 undesirable_weight: float, reference=None):
        self.batch_options = batch_options
        self.beta = beta
        self.fp32 = fp32
        self.desirable_weight = desirable_weight
        self.undesirable_weight = undesirable_weight
        self.reference = reference  # the frozen model; None when precomputed

    def __call__(self, engine, samples):
        batch = get_batch({key: samples[key] for key in ("text", "label", "segment") if key in samples},
                          self.batch_options).to(current_device())
        policy = target_log_probs(engine, batch, self.fp32).float()
        reference = reference_log_probs(self.reference, batch, self.fp32, samples.get("ref"))
        ratios = policy - reference
        if batch.documents is None:
            log_ratio = ratios.sum(dim=1)
            reward = sample_rewards(samples["reward"].to(batch.loss_mask.device), batch.loss_mask)
        else:
            log_ratio, reward = document_log_ratios_and_rewards(ratios, samples["reward"].to(ratios.device), batch)
        sign = torch.sign(torch.where(reward.abs() > _NEUTRAL, reward, torch.zeros_like(reward)))
        weight = torch.where(sign > 0, self.desirable_weight, self.undesirable_weight) * sign.abs()
        first, second = log_ratio.detach().clamp(min=0).chunk(2)
        half = first.shape[0]
        reference_point = torch.cat([second.mean().expand(half), first.mean().expand(log_ratio.shape[0] - half)])
        loss = (weight * (1 - torch.sigmoid(self.beta * sign * (log_ratio - reference_point)))).mean()
        implied = (self.beta * sign * log_ratio).detach()
        return loss, {"kl": ratios.detach().sum() / batch.loss_mask.sum().clamp(min=1.0),
                      "reward_acc": (implied > 0).float().mean()}
