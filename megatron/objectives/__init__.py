"""Training objectives: what one micro batch's loss is, chosen by `train_impl` (GPT-NeoX's setting).

| train_impl | module           | samples' keys (from the dataset)           | reference model     |
|------------|------------------|--------------------------------------------|---------------------|
| normal     | language_model   | text [, label]                             | none                |
| dpo        | dpo              | pos, neg, pos_label, neg_label [, *_ref]   | unless reference-free or precomputed |
| kto        | kto              | text, label, reward [, ref]                | unless precomputed  |
| rm         | reward_model     | pos, neg, pos_label, neg_label             | none                |
| reinforce  | reinforce        | text, label, reward, raw_reward (rollouts) | when kl_div_beta > 0 |

An objective is called with the engine and one micro batch of collated samples and returns the
loss to minimise (a 0-dim tensor, what `engine.backward` takes) and its metrics (0-dim tensors named
as GPT-NeoX names them, in `metric_names` order; those named there go into the iteration and evaluation lines,
every one to TensorBoard, as each expert's load does). The training loop only averages and reports them:
it knows no objective by name. Objectives that compare against a frozen reference get it at
construction, from the load plan.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from megatron.data import BatchOptions


class Objective(Protocol):
    metric_names: tuple[str, ...]  # what the lines show besides the loss, in their order
    reports_perplexity: bool  # exp(loss) means something only for a language-model loss

    def __call__(self, engine, samples: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ...


def mean_over_micro_batches_and_ranks(results: list[tuple[torch.Tensor, dict]]) -> tuple[float, dict[str, float]]:
    """The loss and each metric of an objective's micro batches (``results``) averaged over the micro batches,
    then over the ranks (one all-reduce): what the training loop reports."""
    names = list(results[0][1])
    values = torch.stack([torch.stack([loss.detach().float(), *(metrics[n].detach().float() for n in names)])
                          for loss, metrics in results]).mean(dim=0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
        values /= dist.get_world_size()
    loss, *metric_values = values.tolist()
    return loss, dict(zip(names, metric_values, strict=True))


def objective_for(args, batch_options: BatchOptions, reference=None) -> Objective:
    """The objective `args.train_impl` names; `reference` is the frozen reference model where it needs one."""
    from megatron.objectives.dpo import DirectPreferenceOptimization
    from megatron.objectives.kto import KahnemanTverskyOptimization
    from megatron.objectives.language_model import LanguageModelLoss
    from megatron.objectives.reinforce import Reinforce
    from megatron.objectives.reward_model import RewardModelLoss

    if args.train_impl == "dpo":
        return DirectPreferenceOptimization(batch_options, args.dpo_beta, args.dpo_fp32, reference,
                                            args.dpo_reference_free)
    if args.train_impl == "kto":
        return KahnemanTverskyOptimization(batch_options, args.kto_beta, args.kto_fp32, args.kto_desirable_weight,
                                           args.kto_undesirable_weight, reference)
    if args.train_impl == "reinforce":
        return Reinforce(batch_options, args.kl_impl, args.kl_div_beta, args.fp32_reinforce, reference)
    if args.train_impl == "rm":
        return RewardModelLoss(batch_options, args.z_loss)
    return LanguageModelLoss(batch_options, args.architecture())
