"""From a collated batch of samples to what the model and the loss read: inputs, targets, loss mask,
and, for packed documents that must not see each other, per-document positions and attention.

GPT-NeoX's rules: inputs are text[:, :-1] and targets text[:, 1:], or label[:, 1:] when the batch has
labels (the label file is aligned with the tokens, not shifted); a negative target is masked and
replaced by 0. eod_mask_loss also masks every position whose input is the eod token. Megatron-LM's
reset_position_ids / reset_attention_mask start the positions again after each eod token and keep
a token from attending to anything before the eod that precedes it.

Packed preference pairs carry their documents' bounds from the dataset instead (a `segment` per token, -1
outside the sample's documents), since a chat may hold eod tokens of its own and each pair must be scored
apart: the same two settings then restart the positions and block the attention per segment, a target in
another segment than its input is never trained, and `Batch.documents` tells the objectives whose it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchOptions:
    eod: int | None = None  # the tokenizer's end-of-document id, needed by the three settings below
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @classmethod
    def from_args(cls, args, eod: int | None) -> BatchOptions:
        return cls(eod, args.eod_mask_loss, args.reset_position_ids, args.reset_attention_mask)


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s] inputs
    labels: torch.Tensor  # [b, s] next-token targets, 0 where masked
    loss_mask: torch.Tensor  # [b, s] float, 1 where the target is trained
    position_ids: torch.Tensor | None = None  # [b, s]; None: 0 .. s-1 in every row
    attention_mask: torch.Tensor | None = None  # [b, 1, s, s] bool, True where a query may see a key; None: causal
    documents: torch.Tensor | None = None  # [b, s] the packed document of each input, -1 none; None: one per row

    def to(self, device) -> Batch:
        return Batch(*(None if t is None else t.to(device) for t in
                       (self.tokens, self.labels, self.loss_mask, self.position_ids, self.attention_mask,
                        self.documents)))


def document_positions(tokens: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document number, position within the document) of every token; a document ends with its eod."""
    is_eod = tokens == eod
    document = torch.cumsum(is_eod, dim=1) - is_eod.long()
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    after_eod = torch.where(is_eod, index + 1, torch.zeros_like(index))
    start = torch.cummax(torch.cat([torch.zeros_like(index[:, :1]), after_eod[:, :-1]], dim=1), dim=1).values
    return document, index - start


def segment_positions(segment: torch.Tensor) -> torch.Tensor:
    """The position of every token within its run of equal segment numbers."""
    index = torch.arange(segment.shape[1], device=segment.device).expand_as(segment)
    starts = torch.ones_like(segment, dtype=torch.bool)
    starts[:, 1:] = segment[:, 1:] != segment[:, :-1]
    return index - torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values


def block_causal_mask(document: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool: a query sees the keys at or before it in its own document."""
    causal = torch.ones(document.shape[1], document.shape[1], dtype=torch.bool, device=document.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal).unsqueeze(1)


def get_batch(batch: dict[str, torch.Tensor], options: BatchOptions = BatchOptions()) -> Batch:
    text = batch["text"].long()
    tokens = text[:, :-1].contiguous()
    targets = batch["label"].long()[:, 1:] if "label" in batch else text[:, 1:]
    trained = targets >= 0
    labels = torch.where(trained, targets, torch.zeros_like(targets)).contiguous()
    loss_mask = trained.float()
    if options.eod_mask_loss or options.reset_position_ids or options.reset_attention_mask:
        if options.eod is None:
            raise ValueError("eod_mask_loss / reset_position_ids / reset_attention_mask need the tokenizer's eod id")
    if options.eod_mask_loss:
        loss_mask = loss_mask * (tokens != options.eod).float()
    if "segment" in batch:
        return _segmented(tokens, labels, loss_mask, batch["segment"].long(), options)
    position_ids = attention_mask = None
    if options.reset_position_ids or options.reset_attention_mask:
        document, position = document_positions(tokens, options.eod)
        if options.reset_position_ids:
            position_ids = position
        if options.reset_attention_mask:
            attention_mask = block_causal_mask(document)
    return Batch(tokens, labels, loss_mask, position_ids, attention_mask)


def _segmented(tokens, labels, loss_mask, segment: torch.Tensor, options: BatchOptions) -> Batch:
    documents = segment[:, :-1].contiguous()
    own_target = (documents >= 0) & (documents == segment[:, 1:])
    return Batch(tokens, labels, loss_mask * own_target.float(),
                 segment_positions(documents) if options.reset_position_ids else None,
                 block_causal_mask(documents) if options.reset_attention_mask else None, documents)


def pairwise_batch(samples: dict[str, torch.Tensor], options: BatchOptions = BatchOptions()) -> Batch:
    """The batch of pairwise samples: the chosen rows, then the rejected rows (GPT-NeoX's cat(pos, neg) along
    the batch, which torch.chunk(., 2) splits back)."""
    pairs = {"text": torch.cat([samples["pos"], samples["neg"]]),
             "label": torch.cat([samples["pos_label"], samples["neg_label"]])}
    if "pos_segment" in samples:
        pairs["segment"] = torch.cat([samples["pos_segment"], samples["neg_segment"]])
    return get_batch(pairs, options)


def document_sums(values: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """values [b, s] summed per document: ([b, d], present [b, d] bool), d the most documents a row holds;
    a row of one document (no `documents`) gives d = 1."""
    if batch.documents is None:
        return values.sum(dim=1, keepdim=True), torch.ones(values.shape[0], 1, dtype=torch.bool, device=values.device)
    count = int(batch.documents.max()) + 1
    inside = batch.documents >= 0
    index = batch.documents.clamp(min=0)
    sums = values.new_zeros(values.shape[0], count).scatter_add(1, index, values * inside)
    tokens = torch.zeros(values.shape[0], count, dtype=torch.long, device=values.device).scatter_add(1, index, inside.long())
    return sums, tokens > 0
