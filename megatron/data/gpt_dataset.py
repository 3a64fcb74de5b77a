"""GPT samples of seq_length + 1 tokens, built the three GPT-NeoX ways (`pack_impl`), labels riding along.

Three index arrays, built once and cached (index_cache):
  doc_idx     documents in the order samples read them
  sample_idx  (samples + 1, 2): where sample i starts as [position in doc_idx, token offset]; sample i
              ends where sample i + 1 starts, plus one token (consecutive samples share one token)
  shuffle_idx the order in which samples are served

packed               documents shuffled per epoch and concatenated, cut every seq_length tokens
pack_until_overflow  whole documents, shuffled, appended to a sample until the next would overflow
unpacked             one document per sample, in document order, the samples shuffled
In the last two a sample is its documents, then the first token of the next sample's first document
(GPT-NeoX's one-token overlap), cut or padded to seq_length + 1; a document whose labels are all
masked is skipped, and with allow_chopped false so is one longer than seq_length + 1.

With a label dataset (aligned with the tokens, negative where the loss is masked) every item has
"text" and "label"; the non-packed modes always give "label" (the tokens themselves when there is no
label file), -100 on padding, so padding is never trained. With a reward dataset (one value per document,
unpacked or pack_until_overflow) items also have "reward", float32 per token: each token carries its
document's value, as GPT-NeoX broadcasts it, the borrowed token its own document's, padding 0; with
pack_until_overflow also "segment" (which of the sample's documents each token is, -1 on padding and the
borrowed token), so KTO scores each document as a sample of its own. With precomputed reference
log-probabilities (precompute_model_name, unpacked only: one document of seq_length values per document)
items also have "ref", float32, read like the tokens, 0 on padding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron.data.errors import DataError
from megatron.data.index_cache import data_fingerprint, load_or_build
from megatron.data.indexed_dataset import MMapIndexedDataset

INDEX_FORMAT_VERSION = 2
PACK_IMPLS = ("packed", "pack_until_overflow", "unpacked")
PAD_TOKEN, PAD_LABEL, PAD_REWARD = 0, -100, 0.0


def build_sample_indices(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """packed: doc_idx, sample_idx and shuffle_idx covering at least num_samples samples."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    # Every sample consumes seq_length tokens and needs one more token after them.
    num_epochs = -(-(num_samples * seq_length + 1) // tokens_per_epoch)
    rng = np.random.RandomState(seed)
    doc_idx = np.concatenate([rng.permutation(documents) for _ in range(num_epochs)]).astype(np.int32)
    ends = np.cumsum(sizes[doc_idx].astype(np.int64))
    total_samples = (int(ends[-1]) - 1) // seq_length
    starts = np.arange(total_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(ends, starts, side="right")
    offsets = starts - np.concatenate([[0], ends])[positions]
    sample_idx = np.stack([positions, offsets], axis=1).astype(np.int64)
    shuffle_idx = rng.permutation(total_samples).astype(np.int64)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def build_unpacked_indices(usable: np.ndarray, documents: np.ndarray, num_samples: int, seed: int) -> dict[str, np.ndarray]:
    """unpacked: sample i is the i-th usable document, cycling through the documents in order."""
    rng = np.random.RandomState(seed)
    shuffle_idx = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(shuffle_idx)
    doc_idx = np.resize(documents[usable], num_samples + 1).astype(np.int64)  # +1: the borrowed next token
    sample_idx = np.stack([np.arange(num_samples + 1), np.zeros(num_samples + 1)], axis=1).astype(np.int64)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def build_overflow_indices(
    sizes: np.ndarray, usable: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """pack_until_overflow: documents visited in a shuffled order (reshuffled after every pass), each
    appended to the current sample unless it would make it longer than seq_length + 1."""
    rng = np.random.RandomState(seed)
    shuffle_idx = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(shuffle_idx)
    order = np.arange(len(documents))
    rng.shuffle(order)
    doc_idx: list[int] = []
    sample_starts: list[int] = []
    running = 0
    position = 0
    while len(sample_starts) < num_samples:
        local = order[position]
        if usable[local]:
            length = int(sizes[documents[local]])
            if running == 0 or running + length > seq_length + 1:
                sample_starts.append(len(doc_idx))
                running = length
            else:
                running += length
            doc_idx.append(int(documents[local]))
        position += 1
        if position == len(documents):
            position = 0
            rng.shuffle(order)
    sample_starts.append(len(doc_idx))
    sample_idx = np.stack([np.asarray(sample_starts), np.zeros(len(sample_starts))], axis=1).astype(np.int64)
    return {"doc_idx": np.asarray(doc_idx, dtype=np.int64), "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def usable_documents(
    sizes: np.ndarray, documents: np.ndarray, label_dataset: MMapIndexedDataset | None, label_window: int,
    longest: int | None,
) -> np.ndarray:
    """Per document of `documents`: not longer than `longest` (None: any length) and with a trained label
    among its first `label_window` labels."""
    usable = np.ones(len(documents), dtype=bool)
    if longest is not None:
        usable &= sizes[documents] <= longest
    if label_dataset is not None:
        for i, doc in enumerate(documents):
            if usable[i]:
                usable[i] = bool((label_dataset.get(int(doc), 0, min(label_window, int(sizes[doc]))) >= 0).any())
    return usable


def usable_in_every_file(sides, documents: np.ndarray, window: int, longest: int | None) -> np.ndarray:
    """Per document of `documents`: usable (usable_documents) in every file a sample takes it from; `sides` are
    (sizes, label dataset or None) pairs, one per such file (a pairwise sample takes the chosen and the rejected)."""
    return np.logical_and.reduce([usable_documents(sizes, documents, labels, window, longest) for sizes, labels in sides])


def check_some_document_usable(name: str, prefix: str, sides, documents: np.ndarray, seq_length: int, pack_impl: str,
                               allow_chopped: bool, chunk: int = 1024) -> None:
    """Refuse a split of whole-document samples (pack_impl unpacked or pack_until_overflow) none of whose documents
    is usable; reads labels a chunk of documents at a time, up to the first usable one."""
    window, longest = label_window(pack_impl, seq_length), None if allow_chopped else seq_length + 1
    for start in range(0, len(documents), chunk):
        if usable_in_every_file(sides, documents[start:start + chunk], window, longest).any():
            return
    raise DataError(
        f"the {name} split of {prefix!r} has no document to sample with pack_impl "
        f"{pack_impl}: every one is " + ("longer than seq_length + 1 or " if not allow_chopped else "")
        + "without a trained label; use allow_chopped: true, a longer seq_length, or other data")


class GPTDataset:
    """Item i: {"text": int64[seq_length + 1]} (and "label", see the module doc); len() >= num_samples."""

    def __init__(
        self,
        name: str,
        indexed_dataset: MMapIndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        index_cache_dir: str | Path | None = None,
        pack_impl: str = "packed",
        allow_chopped: bool = True,
        label_dataset: MMapIndexedDataset | None = None,
        reward_dataset: MMapIndexedDataset | None = None,
        reference_dataset: MMapIndexedDataset | None = None,
    ):
        if len(documents) == 0 or np.any(np.diff(documents) != 1):
            raise DataError("GPTDataset documents must be a non-empty, contiguous range of document ids")
        if pack_impl not in PACK_IMPLS:
            raise DataError(f"pack_impl {pack_impl!r} is not one of {PACK_IMPLS}")
        check_gpt_files(name, indexed_dataset, documents, seq_length, pack_impl, label_dataset, reward_dataset,
                        reference_dataset, allow_chopped)
        sizes = indexed_dataset.sizes
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.label_dataset = label_dataset
        self.reward_dataset = reward_dataset
        self.reference_dataset = reference_dataset
        self.seq_length = seq_length
        self.pads = pack_impl != "packed"
        self.segmented = pack_impl == "pack_until_overflow"
        settings = {
            "version": INDEX_FORMAT_VERSION,
            "split": name,
            "documents": [int(documents[0]), int(documents[-1]) + 1],
            "num_samples": int(num_samples),
            "seq_length": int(seq_length),
            "seed": int(seed),
            "pack_impl": pack_impl,
        }
        if self.pads:
            settings["allow_chopped"] = bool(allow_chopped)
            settings["labels"] = data_fingerprint(label_dataset.prefix) if label_dataset is not None else None
        arrays, self.built_index = load_or_build(
            indexed_dataset.prefix,
            name,
            settings,
            lambda: self._build(sizes, documents, num_samples, seq_length, seed, pack_impl, allow_chopped),
            index_cache_dir,
        )
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def _build(self, sizes, documents, num_samples, seq_length, seed, pack_impl, allow_chopped):
        if pack_impl == "packed":
            return build_sample_indices(sizes, documents, num_samples, seq_length, seed)
        usable = usable_in_every_file([(sizes, self.label_dataset)], documents, label_window(pack_impl, seq_length),
                                      None if allow_chopped else seq_length + 1)
        return whole_document_indices(sizes, usable, documents, num_samples, seq_length, seed, pack_impl)

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        sample = int(self.shuffle_idx[idx])
        pieces = read_pieces(self.indexed_dataset, self.doc_idx, self.sample_idx, sample)
        text = np.concatenate(pieces)
        if not self.pads and self.label_dataset is None:
            return {"text": text.astype(np.int64)}
        labels = text if self.label_dataset is None else read_sample(self.label_dataset, self.doc_idx,
                                                                     self.sample_idx, sample)
        item = {"text": fit(text, self.seq_length, PAD_TOKEN), "label": fit(labels, self.seq_length, PAD_LABEL)}
        if self.reward_dataset is not None:
            first_doc, last_doc = int(self.sample_idx[sample][0]), int(self.sample_idx[sample + 1][0])
            docs = self.doc_idx[first_doc:last_doc + 1]
            rewards = np.concatenate([np.full(len(piece), self.reward_dataset.get(int(doc))[0], dtype=np.float32)
                                      for piece, doc in zip(pieces, docs, strict=True)])
            item["reward"] = fit(rewards, self.seq_length, PAD_REWARD, np.float32)
            if self.segmented:  # packed kto: each document is a sample of its own
                item["segment"] = fit(sample_segments(pieces, self.sample_idx, sample), self.seq_length, -1)
        if self.reference_dataset is not None:
            ref = read_sample(self.reference_dataset, self.doc_idx, self.sample_idx, sample)
            item["ref"] = fit(ref, self.seq_length, 0.0, np.float32)
        return item


def check_gpt_files(name: str, data: MMapIndexedDataset, documents: np.ndarray, seq_length: int, pack_impl: str,
                    labels: MMapIndexedDataset | None = None, rewards: MMapIndexedDataset | None = None,
                    reference: MMapIndexedDataset | None = None, allow_chopped: bool = True) -> None:
    """What a GPTDataset of split `name` (`documents` of `data`) checks of its files before it indexes them, and
    deepy.py --dry-run with it (megatron.data.builders.check_data_files): labels of the same lengths, one finite
    reward per document, precomputed log-probabilities that fit, enough tokens for one packed sample, a document
    a whole-document sample can use."""
    if labels is not None and not np.array_equal(labels.sizes, data.sizes):
        raise DataError(
            f"label dataset {labels.prefix!r} does not match {data.prefix!r}: {len(labels)} and {len(data)} "
            "documents, or documents of other lengths; give each data path the label file written with it "
            "(preprocess_data_with_chat_template.py writes both)")
    if rewards is not None:
        check_rewards(rewards, data, pack_impl)
    if reference is not None:
        check_reference_log_probs(reference, data, seq_length, pack_impl)
    tokens = int(data.sizes[documents].sum(dtype=np.int64))
    if pack_impl == "packed" and tokens <= seq_length:
        raise DataError(
            f"the {name} split of {data.prefix!r} (documents {documents[0]}..{documents[-1]}) holds {tokens} tokens, "
            f"fewer than one sample of seq_length + 1 = {seq_length + 1}; give it more data (a larger share in "
            "`split`, or more documents) or use a shorter seq_length"
        )
    if pack_impl != "packed":
        check_some_document_usable(name, data.prefix, [(data.sizes, labels)], documents, seq_length, pack_impl,
                                   allow_chopped)


def check_rewards(rewards: MMapIndexedDataset, data: MMapIndexedDataset, pack_impl: str) -> None:
    if pack_impl == "packed":
        raise DataError(f"reward dataset {rewards.prefix!r}: rewards are per document, so they need whole documents: "
                        "pack_impl unpacked (one document per sample, as GPT-NeoX asserts) or pack_until_overflow, "
                        "not packed")
    if len(rewards) != len(data) or (rewards.sizes != 1).any():
        raise DataError(f"reward dataset {rewards.prefix!r} holds {len(rewards)} documents "
                        f"{'' if (rewards.sizes == 1).all() else 'not all of one value '}for the {len(data)} "
                        f"documents of {data.prefix!r}; give each data path the reward file written with it "
                        "(preprocess_data_with_chat_template.py --reward-key)")
    not_finite = np.flatnonzero(~np.isfinite(rewards.values()))
    if len(not_finite):
        first = int(not_finite[0])
        raise DataError(f"reward dataset {rewards.prefix!r}: document {first} has reward {rewards.get(first)[0]} "
                        f"({len(not_finite)} documents in all are not finite numbers); a reward must be a finite "
                        "number (above 0: desirable, below 0: undesirable); fix the records' rewards and write the "
                        "file again (preprocess_data_with_chat_template.py --reward-key)")


def check_reference_log_probs(ref: MMapIndexedDataset, data: MMapIndexedDataset, seq_length: int,
                              pack_impl: str) -> None:
    """Precomputed reference log-probabilities must be float32, one document of seq_length values per document
    of `data`, served one document per sample."""
    if pack_impl != "unpacked":
        raise DataError(f"precomputed log-probabilities {ref.prefix!r} are one document of seq_length values per "
                        "document, so they need pack_impl: unpacked (packed with others they would no longer line "
                        "up with the tokens)")
    lengths = set(np.unique(ref.sizes).tolist())
    if ref.dtype != np.float32 or len(ref) != len(data) or lengths - {seq_length}:
        raise DataError(f"precomputed log-probabilities {ref.prefix!r} hold {len(ref)} {ref.dtype} documents of "
                        f"{sorted(lengths)} values, but {data.prefix!r} has {len(data)} documents and seq_length is "
                        f"{seq_length}: they were written for other data or another seq_length. Delete "
                        f"{ref.prefix}.bin/.idx and write them again with generate.py (text_gen_type: precompute, "
                        "load: the reference model, this run's data and seq_length)")


def label_window(pack_impl: str, seq_length: int) -> int:
    """GPT-NeoX's windows of the label check: unpacked looks at the first seq_length labels,
    pack_until_overflow at seq_length + 1."""
    return seq_length if pack_impl == "unpacked" else seq_length + 1


def whole_document_indices(sizes, usable, documents, num_samples, seq_length, seed, pack_impl) -> dict[str, np.ndarray]:
    """unpacked or pack_until_overflow indices over the usable documents (sizes: what a document takes of a
    sample); the files were checked to hold one (check_some_document_usable)."""
    if pack_impl == "unpacked":
        return build_unpacked_indices(usable, documents, num_samples, seed)
    return build_overflow_indices(sizes, usable, documents, num_samples, seq_length, seed)


def read_pieces(data: MMapIndexedDataset, doc_idx: np.ndarray, sample_idx: np.ndarray, sample: int) -> list[np.ndarray]:
    """What sample `sample` takes of each of its documents (in doc_idx order), from `data`."""
    first_doc, first_offset = (int(v) for v in sample_idx[sample])
    last_doc, last_offset = (int(v) for v in sample_idx[sample + 1])
    if first_doc == last_doc:
        return [data.get(int(doc_idx[first_doc]), first_offset, last_offset - first_offset + 1)]
    pieces = [data.get(int(doc_idx[first_doc]), first_offset)]
    pieces += [data.get(int(doc_idx[d])) for d in range(first_doc + 1, min(last_doc, len(doc_idx)))]
    if last_doc < len(doc_idx):  # the last overflow sample has no next document to borrow from
        pieces.append(data.get(int(doc_idx[last_doc]), 0, min(last_offset + 1, int(data.sizes[doc_idx[last_doc]]))))
    return pieces


def sample_segments(pieces: list[np.ndarray], sample_idx: np.ndarray, sample: int) -> np.ndarray:
    """Which of a whole-document sample's documents each of its tokens is (0, 1, ...), -1 on the token it
    takes of the next sample's first document; ``pieces``: the sample's read_pieces."""
    owned = int(sample_idx[sample + 1][0]) - int(sample_idx[sample][0])
    return np.concatenate([np.full(len(piece), k if k < owned else -1) for k, piece in enumerate(pieces)])


def read_sample(data: MMapIndexedDataset, doc_idx: np.ndarray, sample_idx: np.ndarray, sample: int) -> np.ndarray:
    return np.concatenate(read_pieces(data, doc_idx, sample_idx, sample))


def fit(values: np.ndarray, seq_length: int, pad, dtype=np.int64) -> np.ndarray:
    """values cut or padded with `pad` to seq_length + 1."""
    values = values[: seq_length + 1].astype(dtype)
    return np.pad(values, (0, seq_length + 1 - len(values)), constant_values=pad)
