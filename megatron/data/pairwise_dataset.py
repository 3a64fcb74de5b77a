"""Pairs of documents, chosen doc k with rejected doc k, as GPT-NeoX's `dataset_impl: pairwise` serves them.

Item i: {"pos", "neg"} (int64[seq_length + 1]), their labels {"pos_label", "neg_label"} (the tokens
themselves, -100 on padding, when no label files are given) and, with precomputed reference
log-probabilities, {"pos_ref", "neg_ref"} (float32, 0 on padding). One index (gpt_dataset's unpacked or
pack_until_overflow) serves both sides, so a sample holds the same document numbers on each; a pair is
usable when both sides are (a trained label, and with allow_chopped false no side longer than
seq_length + 1), and pack_until_overflow counts the longer side.

pack_until_overflow also gives {"pos_segment", "neg_segment"} (int64[seq_length + 1]): which of the sample's
documents each token belongs to (0, 1, ...; -1 on padding and on the one token the sample takes of the next
sample's first document). Document k is the same pair on both sides, so the objectives can score each pair
apart (megatron.data.batches keeps the documents from seeing each other and restarts their positions).

GPT-NeoX's bugs not copied: its allow_chopped false keeps only the documents that do NOT fit
(pairwise_dataset.py:258-270); its index cache name ignores allow_chopped and the label files, so
changing them reused a stale index; unpacked without label files crashed; and its unpacked order cycles
`i % documents` over a list that skips documents, serving some pairs twice an epoch. Here each usable
pair is served once per pass, in the order gpt_dataset draws for `unpacked`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron.data.errors import DataError
from megatron.data.gpt_dataset import (
    INDEX_FORMAT_VERSION,
    PAD_LABEL,
    PAD_TOKEN,
    check_reference_log_probs,
    check_some_document_usable,
    fit,
    label_window,
    read_pieces,
    read_sample,
    sample_segments,
    usable_in_every_file,
    whole_document_indices,
)
from megatron.data.index_cache import data_fingerprint, load_or_build
from megatron.data.indexed_dataset import MMapIndexedDataset

SIDES = ("pos", "neg")


def _check_same_documents(first: MMapIndexedDataset, second: MMapIndexedDataset, what: str) -> None:
    if len(first) != len(second):
        raise DataError(f"{what}: {first.prefix!r} holds {len(first)} documents but {second.prefix!r} holds "
                        f"{len(second)}; chosen document k pairs with rejected document k, so give files written "
                        "from the same jsonl (preprocess_data_with_chat_template.py --jsonl-keys chosen, then rejected)")


def check_pairwise_files(name: str, pos: MMapIndexedDataset, neg: MMapIndexedDataset, seq_length: int,
                         pack_impl: str, pos_label: MMapIndexedDataset | None = None,
                         neg_label: MMapIndexedDataset | None = None, pos_ref: MMapIndexedDataset | None = None,
                         neg_ref: MMapIndexedDataset | None = None, allow_chopped: bool = True) -> None:
    """What a PairwiseDataset of split `name` checks of its files before it indexes them, and deepy.py --dry-run
    with it (megatron.data.builders.check_data_files): as many chosen as rejected documents, labels and
    precomputed log-probabilities on both sides or neither, each fitting its documents, a pair a sample can use."""
    _check_same_documents(pos, neg, f"the {name} pairs")
    if (pos_label is None) != (neg_label is None):
        raise DataError(f"the {name} pairs of {pos.prefix!r}: give label files for both the chosen and the "
                        "rejected documents, or for neither")
    if (pos_ref is None) != (neg_ref is None):
        raise DataError(f"the {name} pairs of {pos.prefix!r}: precomputed log-probabilities are needed for "
                        "both sides, or for neither")
    for data, labels in ((pos, pos_label), (neg, neg_label)):
        if labels is not None and not np.array_equal(labels.sizes, data.sizes):
            raise DataError(
                f"label dataset {labels.prefix!r} does not match {data.prefix!r}: {len(labels)} and {len(data)} "
                "documents, or documents of other lengths; give each data path the label file written with it")
    for data, ref in ((pos, pos_ref), (neg, neg_ref)):
        if ref is not None:
            check_reference_log_probs(ref, data, seq_length, pack_impl)
    if pack_impl != "packed":
        check_some_document_usable(f"{name} pairs", pos.prefix, [(pos.sizes, pos_label), (neg.sizes, neg_label)],
                                   np.arange(len(pos)), seq_length, pack_impl, allow_chopped)


class PairwiseDataset:
    def __init__(
        self,
        name: str,
        pos: MMapIndexedDataset,
        neg: MMapIndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        index_cache_dir: str | Path | None = None,
        pack_impl: str = "unpacked",
        allow_chopped: bool = True,
        pos_label: MMapIndexedDataset | None = None,
        neg_label: MMapIndexedDataset | None = None,
        pos_ref: MMapIndexedDataset | None = None,
        neg_ref: MMapIndexedDataset | None = None,
    ):
        if pack_impl == "packed":
            raise DataError("dataset_impl pairwise needs whole documents: set pack_impl to unpacked or "
                            "pack_until_overflow (packed cuts a chosen and its rejected document apart)")
        if len(documents) == 0 or np.any(np.diff(documents) != 1):
            raise DataError("PairwiseDataset documents must be a non-empty, contiguous range of document ids")
        check_pairwise_files(name, pos, neg, seq_length, pack_impl, pos_label, neg_label, pos_ref, neg_ref,
                             allow_chopped)
        self.name = name
        self.seq_length = seq_length
        self.segmented = pack_impl == "pack_until_overflow"
        self.data = {"pos": pos, "neg": neg}
        self.labels = {"pos": pos_label, "neg": neg_label}
        self.refs = {"pos": pos_ref, "neg": neg_ref}
        settings = {
            "version": INDEX_FORMAT_VERSION,
            "split": name,
            "documents": [int(documents[0]), int(documents[-1]) + 1],
            "num_samples": int(num_samples),
            "seq_length": int(seq_length),
            "seed": int(seed),
            "pack_impl": pack_impl,
            "allow_chopped": bool(allow_chopped),
            "pairwise": {side: {"data": data_fingerprint(self.data[side].prefix),
                                "labels": None if self.labels[side] is None
                                else data_fingerprint(self.labels[side].prefix)} for side in SIDES},
        }
        arrays, self.built_index = load_or_build(
            pos.prefix, f"{name}_pairwise", settings,
            lambda: self._build(documents, num_samples, seq_length, seed, pack_impl, allow_chopped),
            index_cache_dir,
        )
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def _build(self, documents, num_samples, seq_length, seed, pack_impl, allow_chopped):
        usable = usable_in_every_file([(self.data[side].sizes, self.labels[side]) for side in SIDES], documents,
                                      label_window(pack_impl, seq_length), None if allow_chopped else seq_length + 1)
        sizes = np.maximum(self.data["pos"].sizes, self.data["neg"].sizes)
        return whole_document_indices(sizes, usable, documents, num_samples, seq_length, seed, pack_impl)

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        sample = int(self.shuffle_idx[idx])
        item = {}
        for side in SIDES:
            pieces = read_pieces(self.data[side], self.doc_idx, self.sample_idx, sample)
            text = np.concatenate(pieces)
            labels = text if self.labels[side] is None else read_sample(self.labels[side], self.doc_idx,
                                                                        self.sample_idx, sample)
            item[side] = fit(text, self.seq_length, PAD_TOKEN)
            item[f"{side}_label"] = fit(labels, self.seq_length, PAD_LABEL)
            if self.refs[side] is not None:
                ref = read_sample(self.refs[side], self.doc_idx, self.sample_idx, sample)
                item[f"{side}_ref"] = fit(ref, self.seq_length, 0.0, np.float32)
            if self.segmented:
                item[f"{side}_segment"] = fit(sample_segments(pieces, self.sample_idx, sample), self.seq_length, -1)
        return item
