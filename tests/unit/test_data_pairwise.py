"""dataset_impl pairwise (chosen document k with rejected document k) and per-document rewards, on files
written by tools/datasets/preprocess_data_with_chat_template.py. Expected samples come from the chat
template applied by hand (tests/e2e/test_preprocess_chat.py's tokenizer) and GPT-NeoX's RandomState draws."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron.data import DataError, MMapIndexedDataset, build_train_valid_test_datasets
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.pairwise_dataset import PairwiseDataset
from megatron.neox_arguments import ConfigError, NeoXArgs
from tests.e2e.test_preprocess_chat import EOS, ids, make_chat_tokenizer, run, write_jsonl
from tests.unit.test_data_gpt_dataset import make_args
from tests.unit.test_neox_args import TINY_RUN

M = -100
SEQ = 16
PROMPTS = ["hi", "what is two plus four", "hello", "bye"]
CHOSEN = ["hello there", "four", "hi there", "bye bye"]
REJECTED = ["bye", "two plus two is four ok be kind", "what", "ok"]  # pair 1: rejected longer than SEQ + 1 tokens


def chat(prompt: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def rm_tokens(prompt: str, answer: str) -> list[int]:
    """What --for-rm writes for a chat: the rendered template, then eos twice."""
    return ids(f"<|user|> {prompt} <|end|> <|assistant|> {answer} <|end|>") + [EOS, EOS]


@pytest.fixture(scope="module")
def rm_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pairs")
    tokenizer = make_chat_tokenizer(folder / "tokenizer")
    records = [{"chosen": chat(p, c), "rejected": chat(p, r), "score": s}
               for p, c, r, s in zip(PROMPTS, CHOSEN, REJECTED, [1.5, -0.25, 2.0, 0.5], strict=True)]
    source = write_jsonl(folder / "pairs.jsonl", records)
    run("--input", source, "--tokenizer-path", str(tokenizer), "--output-prefix", str(folder / "rm"),
        "--jsonl-keys", "chosen", "rejected", "--for-rm", "--reward-key", "score")
    return folder


def open_side(folder, key: str, label: bool = True):
    data = MMapIndexedDataset(folder / f"rm_{key}_document")
    return data, MMapIndexedDataset(folder / f"rm_{key}_label_document") if label else None


def pairwise(folder, num_samples: int = 6, labels: bool = True, **kwargs) -> PairwiseDataset:
    pos, pos_label = open_side(folder, "chosen", labels)
    neg, neg_label = open_side(folder, "rejected", labels)
    return PairwiseDataset("train", pos, neg, np.arange(len(pos)), num_samples, SEQ, seed=1,
                           pos_label=pos_label, neg_label=neg_label, **kwargs)


def expected_side(doc: int, answers: list[str], usable: list[int], position: int, labels: bool):
    """Unpacked sample `position`: document usable[position] whole, then the first token of the next usable one,
    cut or padded to SEQ + 1 (tokens with 0, labels with -100)."""
    tokens = rm_tokens(PROMPTS[doc], answers[doc])
    following = usable[(position + 1) % len(usable)]
    sample = (tokens + rm_tokens(PROMPTS[following], answers[following])[:1])[: SEQ + 1]
    label = ([M] * (len(tokens) - 1) + [EOS] + [M])[: SEQ + 1] if labels else list(sample)  # borrowed: masked
    return sample + [0] * (SEQ + 1 - len(sample)), label + [M] * (SEQ + 1 - len(label))


# --for-rm labels train only the last position, so a pair cut to SEQ + 1 has no trained label left and is
# skipped (GPT-NeoX's label check) whatever allow_chopped says; without labels allow_chopped decides.
@pytest.mark.parametrize("labels, allow_chopped, usable", [
    (True, True, [0, 2, 3]), (False, True, [0, 1, 2, 3]), (False, False, [0, 2, 3])])
def test_unpacked_sample_i_holds_chosen_and_rejected_document_k(rm_data, labels, allow_chopped, usable):
    assert len(rm_tokens(PROMPTS[1], REJECTED[1])) > SEQ + 1 >= max(len(rm_tokens(p, a)) for p, a in
                                                                       zip(PROMPTS, CHOSEN, strict=True))
    dataset = pairwise(rm_data, labels=labels, allow_chopped=allow_chopped)
    order = np.arange(6)
    np.random.RandomState(1).shuffle(order)
    assert len(dataset) == 6
    for i in range(6):
        position = int(order[i]) % len(usable)
        doc = usable[position]
        item = dataset[i]
        assert sorted(item) == ["neg", "neg_label", "pos", "pos_label"]
        assert (item["pos"].tolist(), item["pos_label"].tolist()) == expected_side(doc, CHOSEN, usable, position,
                                                                                   labels)
        assert (item["neg"].tolist(), item["neg_label"].tolist()) == expected_side(doc, REJECTED, usable, position,
                                                                                   labels)
        assert all(item[key].dtype == np.int64 for key in item)


def test_changing_allow_chopped_builds_a_new_index_not_a_stale_one(rm_data):
    chopped = pairwise(rm_data, labels=False, allow_chopped=True)
    assert sorted({int(d) for d in chopped.doc_idx}) == [0, 1, 2, 3]
    # GPT-NeoX's cache name ignores allow_chopped, so it would serve the index above again.
    whole = pairwise(rm_data, labels=False, allow_chopped=False)
    assert sorted({int(d) for d in whole.doc_idx}) == [0, 2, 3]
    assert not pairwise(rm_data, labels=False, allow_chopped=False).built_index  # and the cache still serves


def test_pack_until_overflow_fills_by_the_longer_side(rm_data):
    dataset = pairwise(rm_data, num_samples=3, pack_impl="pack_until_overflow", allow_chopped=False)
    for i in range(len(dataset)):
        item = dataset[i]
        # Every sample holds the same documents on both sides: as many eos pairs on each.
        assert (item["pos"] == EOS).sum() == (item["neg"] == EOS).sum()
        assert ((item["pos_label"] == EOS).sum() == (item["neg_label"] == EOS).sum()) and (item["pos_label"] == EOS).sum()
    lengths = {d: max(len(rm_tokens(PROMPTS[d], CHOSEN[d])), len(rm_tokens(PROMPTS[d], REJECTED[d]))) for d in (0, 2, 3)}
    for sample in range(3):
        start, end = int(dataset.sample_idx[sample][0]), int(dataset.sample_idx[sample + 1][0])
        assert sum(lengths[int(d)] for d in dataset.doc_idx[start:end]) <= SEQ + 1


def test_without_label_files_the_labels_are_the_tokens_and_padding_is_masked(rm_data):
    item = pairwise(rm_data, labels=False)[0]
    for side in ("pos", "neg"):
        padding = item[side] == 0
        assert item[f"{side}_label"][~padding].tolist() == item[side][~padding].tolist()
        assert (item[f"{side}_label"][padding] == M).all() and padding.any()


def test_bad_pairs_are_refused_in_one_line(rm_data, tmp_path):
    pos, pos_label = open_side(rm_data, "chosen")
    neg, _ = open_side(rm_data, "rejected")
    with pytest.raises(DataError, match="pack_impl to unpacked or pack_until_overflow"):
        PairwiseDataset("train", pos, neg, np.arange(4), 4, SEQ, 1, pack_impl="packed")
    records = [{"chosen": chat("hi", "ok"), "rejected": chat("hi", "bye")}]
    run("--input", write_jsonl(tmp_path / "one.jsonl", records), "--tokenizer-path", str(rm_data / "tokenizer"),
        "--output-prefix", str(tmp_path / "one"), "--jsonl-keys", "rejected", "--for-rm")
    short = MMapIndexedDataset(tmp_path / "one_rejected_document")
    with pytest.raises(DataError) as caught:
        PairwiseDataset("train", pos, short, np.arange(4), 4, SEQ, 1)
    message = str(caught.value)
    assert "\n" not in message and str(rm_data / "rm_chosen_document") in message
    assert str(tmp_path / "one_rejected_document") in message and "4 documents" in message and "holds 1" in message
    with pytest.raises(DataError, match="label files for both"):
        PairwiseDataset("train", pos, neg, np.arange(4), 4, SEQ, 1, pos_label=pos_label)


def pairwise_args(folder, **overrides) -> NeoXArgs:
    sides = {f"{sign}_{split}_{kind}data_paths": [str(folder / f"rm_{key}_{kind}document")]
             for split in ("train", "valid") for sign, key in (("pos", "chosen"), ("neg", "rejected"))
             for kind in ("", "label_")}
    return make_args(dataset_impl="pairwise", pack_impl="unpacked", seq_length=SEQ, **{**sides, **overrides})


def test_pairwise_datasets_from_settings_blend_by_weights(rm_data):
    args = pairwise_args(rm_data)
    train, valid, test = build_train_valid_test_datasets(args, (8, 4, 0))
    assert isinstance(train, PairwiseDataset) and isinstance(valid, PairwiseDataset) and test is None
    assert len(train) == math.ceil(8 * 1.005)
    twice = {f"{s}_train_{k}data_paths": [str(rm_data / f"rm_{key}_{k}document")] * 2
             for s, key in (("pos", "chosen"), ("neg", "rejected")) for k in ("", "label_")}
    blended, _, _ = build_train_valid_test_datasets(pairwise_args(rm_data, train_data_weights=[3, 1], **twice),
                                                    (8, 4, 0))
    assert isinstance(blended, BlendableDataset) and blended.counts.tolist() == [6, 2]
    assert sorted(blended[0]) == ["neg", "neg_label", "pos", "pos_label"]


def test_rewards_ride_along_per_token_with_zero_on_padding(rm_data):
    args = make_args(pack_impl="unpacked", seq_length=SEQ, train_data_paths=[str(rm_data / "rm_chosen_document")],
                     train_label_data_paths=[str(rm_data / "rm_chosen_label_document")],
                     train_reward_data_paths=[str(rm_data / "rm_chosen_reward_document")])
    train, _, _ = build_train_valid_test_datasets(args, (4, 0, 0))
    scores = [1.5, -0.25, 2.0, 0.5]
    order = np.arange(math.ceil(4 * 1.005))
    np.random.RandomState(1234).shuffle(order)
    for i in range(4):
        doc = int(order[i]) % 4
        length = min(len(rm_tokens(PROMPTS[doc], CHOSEN[doc])), SEQ + 1)
        item = train[i]
        assert item["reward"].dtype == np.float32
        expected = [scores[doc]] * length + [scores[(doc + 1) % 4]] * (length < SEQ + 1)
        assert item["reward"].tolist() == expected + [0.0] * (SEQ + 1 - len(expected))
    packed = make_args(seq_length=SEQ, train_data_paths=args.train_data_paths,
                       train_reward_data_paths=args.train_reward_data_paths)
    with pytest.raises(DataError, match="they need whole documents"):
        build_train_valid_test_datasets(packed, (4, 0, 0))


RUN = {key: value for key, value in TINY_RUN.items() if key != "embedded_corpus"}


@pytest.mark.parametrize("settings, says", [
    ({"pack_impl": "packed"}, r"pack_impl \(default\): dataset_impl pairwise needs whole documents"),
    ({"neg_train_data_paths": None}, "pos_train_data_paths: needs neg_train_data_paths beside it"),
    ({"neg_train_label_data_paths": ["a", "b"]}, "neg_train_label_data_paths: has 2 prefixes for the 1"),
    ({"train_data_paths": ["x"]}, "train_data_paths: dataset_impl pairwise reads pos_train_data_paths"),
    ({"dataset_impl": "gpt2", "train_data_paths": ["x"]}, "pos_train_data_paths: chosen/rejected pairs are read by "
                                                          "dataset_impl: pairwise"),
])
def test_pairwise_settings_are_checked_in_one_line(settings, says):
    pairs = {"dataset_impl": "pairwise", "pos_train_data_paths": ["p"], "neg_train_data_paths": ["n"],
             "pos_train_label_data_paths": ["pl"], "neg_train_label_data_paths": ["nl"], "pack_impl": "unpacked",
             "tokenizer_type": "ByteLevelTokenizer"}
    values = {**RUN, **pairs, **settings}
    if settings.get("pack_impl") == "packed":
        del values["pack_impl"]
    with pytest.raises(ConfigError, match=says):
        NeoXArgs.from_dict(values, require_run_settings=True)


def test_precomputed_log_probabilities_ride_along_as_float32_with_zero_padding(rm_data, tmp_path):
    from megatron.data import MMapIndexedDatasetBuilder

    refs = {}
    for side, key in (("pos", "chosen"), ("neg", "rejected")):
        prefix = tmp_path / f"rm_{key}_document_ref"
        builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.float32)
        for doc in range(4):  # one document of seq_length values per pair, as GPT-NeoX writes them
            builder.add_item(np.full(SEQ, -(doc + 1) / 4 - (side == "neg"), dtype=np.float32))
            builder.end_document()
        builder.finalize(f"{prefix}.idx")
        refs[f"{side}_ref"] = MMapIndexedDataset(prefix)
    dataset = pairwise(rm_data, **refs)
    order = np.arange(6)
    np.random.RandomState(1).shuffle(order)
    usable = [0, 2, 3]
    item = dataset[0]
    doc, following = usable[order[0] % 3], usable[(order[0] + 1) % 3]
    assert item["pos_ref"].dtype == np.float32
    assert item["pos_ref"].tolist() == [-(doc + 1) / 4] * SEQ + [-(following + 1) / 4]
    assert item["neg_ref"].tolist() == [-(doc + 1) / 4 - 1] * SEQ + [-(following + 1) / 4 - 1]
    with pytest.raises(DataError, match="need pack_impl: unpacked"):
        pairwise(rm_data, pack_impl="pack_until_overflow", **refs)
