"""train_impl rm: a Bradley-Terry reward model on chosen/rejected pairs, as GPT-NeoX trains it.

Batch fields: pos, neg, pos_label, neg_label (dataset_impl pairwise). The model's scalar head
(GPTModel with a reward head) gives a value per position; a row's reward is the value at its first
trained position, which for preprocess_data_with_chat_template.py --for-rm data is the first of the two
end tokens appended to the chat. loss = mean(-log sigmoid(r_chosen - r_rejected))
+ z_loss * mean(r_chosen^2 + r_rejected^2). Metrics, GPT-NeoX's: accuracy = mean[r_chosen > r_rejected],
margin = mean(r_chosen - r_rejected), pos_values / neg_values = mean r_chosen / r_rejected.
Unlike GPT-NeoX's (training.py:600-625), a micro batch of one pair works, and a row whose labels train
more than one position reads the first, not a misaligned gather. Packed pairs (pack_until_overflow with
segments): each document's reward is read at its own first trained position, document k of a chosen row
against document k of its rejected row, the means over the micro batch's pairs. With context parallelism the
values of every context-parallel rank's tokens are summed into whole rows on each rank, so each rank reads the
rewards wherever they fall and computes the whole loss (megatron/model/context_parallel.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.data import Batch, BatchOptions, DataError, pairwise_batch
from megatron.model.context_parallel import ContextParallelSplit, whole_sequence_values
from megatron.ranks import context_parallel_rank_and_size
from megatron.runtime.initialize import current_device


def rewards_at_first_trained_position(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """values [b, s] (or [b, s, 1]), loss_mask [b, s] -> [b] fp32: each row's value where its mask is first on."""
    trained = loss_mask > 0
    if not trained.any(dim=1).all():
        raise DataError("a reward-model sample has no trained position to read its reward at; make the pairs with "
                        "tools/datasets/preprocess_data_with_chat_template.py --for-rm and give their label files")
    position = trained.int().argmax(dim=1, keepdim=True)  # argmax returns the first of equal maxima
    return values.reshape(loss_mask.shape).float().gather(1, position).squeeze(1)


def document_rewards(values: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows: ([b, d] each document's value at its first trained position, present [b, d] bool)."""
    documents, trained = batch.documents, batch.loss_mask > 0
    count, length = int(documents.max()) + 1, documents.shape[1]
    index = torch.arange(length, device=documents.device).expand_as(documents)
    inside = documents >= 0
    first = torch.full((documents.shape[0], count), length, dtype=torch.long, device=documents.device)
    first = first.scatter_reduce(1, documents.clamp(min=0), torch.where(trained & inside, index, length), "amin")
    tokens = torch.zeros_like(first).scatter_add(1, documents.clamp(min=0), inside.long())
    present = tokens > 0
    if (first[present] == length).any():
        raise DataError("a packed reward-model document has no trained position to read its reward at; make the "
                        "pairs with tools/datasets/preprocess_data_with_chat_template.py --for-rm and give their "
                        "label files")
    values = values.reshape(documents.shape).float()
    return values.gather(1, first.clamp(max=length - 1)), present


def reward_model_loss(chosen: torch.Tensor, rejected: torch.Tensor, z_loss: float):
    """(loss, metrics) of rewards [b] of the chosen and the rejected sequences."""
    loss = -F.logsigmoid(chosen - rejected).mean() + (z_loss * (chosen**2 + rejected**2)).mean()
    with torch.no_grad():
        margin = chosen - rejected
        metrics = {"accuracy": (margin > 0).float().mean(), "margin": margin.mean(),
                   "pos_values": chosen.mean(), "neg_values": rejected.mean()}
    return loss, metrics


class RewardModelLoss:
    metric_names: tuple[str, ...] = ("accuracy", "margin", "pos_values", "neg_values")
    reports_perplexity = False

    def __init__(self, batch_options: BatchOptions, z_loss: float):
        self.batch_options = batch_options
        self.z_loss = z_loss

    def __call__(self, engine, samples):
        batch = pairwise_batch(samples, self.batch_options).to(current_device())
        values = engine(batch.tokens, position_ids=batch.position_ids, attention_mask=batch.attention_mask)
        if context_parallel_rank_and_size()[1] > 1:  # this rank's tokens' values: every rank gets the whole rows'
            share = ContextParallelSplit.of_this_rank(batch.tokens.shape[1], batch.tokens.device)
            values = whole_sequence_values(values.reshape(values.shape[:2]), share)
        if batch.documents is None:
            chosen, rejected = rewards_at_first_trained_position(values, batch.loss_mask).chunk(2)
            return reward_model_loss(chosen, rejected, self.z_loss)
        rewards, present = document_rewards(values, batch)
        pairs = torch.logical_and(*present.chunk(2))
        chosen, rejected = (side[pairs] for side in rewards.chunk(2))
        return reward_model_loss(chosen, rejected, self.z_loss)
