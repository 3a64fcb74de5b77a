"""Training objectives: what one micro batch's loss is, chosen by `train_impl` (GPT-NeoX's setting).

| train_impl | module           | samples' keys (from the dataset)           | reference model     |
|------------|------------------|--------------------------------------------|---------------------|
| normal     | language_model   | text [, label]                             | none                |
| dpo        | dpo              | pos, neg, pos_label, neg_label [, *_ref]   | unless reference-free or precomputed |
| kto        | kto              | text, label, reward [, ref]                | unless precomputed  |
| rm         | reward_model     | pos, neg, pos_label, neg_label             | none                |

An objective is called with the engine and one micro batch of collated samples and returns the
loss to minimise (a 0-dim tensor, what `engine.backward` takes) and its metrics (0-dim tensors named
as GPT-NeoX names them, in `metric_names` order). The training loop only averages and reports them:
it knows no objective by name. Objectives that compare against a frozen reference get it at
construction, from the load plan.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megatron.data import BatchOptions


class Objective(Protocol):
    metric_names: tuple[str, ...]  # what __call__ reports besides the loss, in the iteration line's order
    reports_perplexity: bool  # exp(loss) means something only for a language-model loss

    def __call__(self, engine, samples: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ...


def objective_for(args, batch_options: BatchOptions, reference=None) -> Objective:
    """The objective `args.train_impl` names; `reference` is the frozen reference model where it needs one."""
    from megatron.objectives.dpo import DirectPreferenceOptimization
    from megatron.objectives.kto import KahnemanTverskyOptimization
    from megatron.objectives.language_model import LanguageModelLoss
    from megatron.objectives.reward_model import RewardModelLoss

    if args.train_impl == "dpo":
        return DirectPreferenceOptimization(batch_options, args.dpo_beta, args.dpo_fp32, reference,
                                            args.dpo_reference_free)
    if args.train_impl == "kto":
        return KahnemanTverskyOptimization(batch_options, args.kto_beta, args.kto_fp32, args.kto_desirable_weight,
                                           args.kto_undesirable_weight, reference)
    if args.train_impl == "rm":
        return RewardModelLoss(batch_options, args.z_loss)
    return LanguageModelLoss(batch_options, args.architecture())
