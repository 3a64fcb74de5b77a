"""precompute_model_name: generate.py's text_gen_type precompute writes the reference's log-probabilities in
GPT-NeoX's layout ({data prefix}_{name}.bin/.idx, float32, one seq_length document per document), and DPO and
KTO reading them have the loss of the reference running live; files that are missing or do not fit the data are
refused in one line naming the file and the command that writes it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from megatron.data import (
    BatchOptions,
    DataError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    build_train_valid_test_datasets,
)
from megatron.data.builders import reference_log_probs_prefix
from megatron.generation.precompute import write_reference_log_probs
from megatron.model import build_model
from megatron.objectives import objective_for
from tests.e2e.test_preprocess_chat import make_chat_tokenizer, run, write_jsonl
from tests.unit.test_data_gpt_dataset import make_args

pytestmark = pytest.mark.usefixtures("single_rank_world")

SEQ = 16
PAIRS = [("hi", "hello there", "bye"), ("what is two plus four", "four", "two plus two"),
         ("hello", "hi there", "what"), ("bye", "bye bye", "ok ok")]


def chat(prompt: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def collated(dataset, count: int) -> dict[str, torch.Tensor]:
    return {key: torch.as_tensor(value) for key, value in default_collate([dataset[i] for i in range(count)]).items()}


def dpo_args(folder, **overrides):
    sides = {f"{sign}_{split}_{kind}data_paths": [str(folder / f"dpo_{key}_{kind}document")]
             for split in ("train", "valid") for sign, key in (("pos", "chosen"), ("neg", "rejected"))
             for kind in ("", "label_")}
    return make_args(dataset_impl="pairwise", pack_impl="unpacked", seq_length=SEQ, train_impl="dpo",
                     padded_vocab_size=128, dpo_beta=0.5, **{**sides, **overrides})


def test_dpo_on_precomputed_log_probs_has_the_live_references_loss(tmp_path):
    tokenizer = make_chat_tokenizer(tmp_path / "tok")
    records = [{"chosen": chat(p, c), "rejected": chat(p, r)} for p, c, r in PAIRS]
    run("--input", write_jsonl(tmp_path / "pairs.jsonl", records), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "chosen", "rejected", "--output-prefix", str(tmp_path / "dpo"))
    args = dpo_args(tmp_path, precompute_model_name="sft")
    with pytest.raises(DataError, match="text_gen_type: precompute"):  # not written yet: one line says how
        build_train_valid_test_datasets(args, (4, 0, 0))

    reference = build_model(args.architecture(), seed=1).eval()
    written = write_reference_log_probs(reference, args, 0, logging.getLogger("test"))
    assert written == [reference_log_probs_prefix(str(tmp_path / f"dpo_{side}_document"), "sft")
                       for side in ("chosen", "rejected")]
    stored = MMapIndexedDataset(written[0])
    chosen = MMapIndexedDataset(tmp_path / "dpo_chosen_document")
    assert stored.dtype == np.float32 and len(stored) == len(chosen)
    assert all(len(stored[i]) == SEQ for i in range(len(stored)))
    assert write_reference_log_probs(reference, args, 0, logging.getLogger("test")) == []  # kept, not rewritten

    train, _, _ = build_train_valid_test_datasets(args, (4, 0, 0))
    samples = collated(train, 4)
    assert {"pos_ref", "neg_ref"} <= samples.keys()
    policy = build_model(args.architecture(), seed=2)
    live_args = dpo_args(tmp_path)
    live_samples = {key: value for key, value in samples.items() if not key.endswith("_ref")}
    live, live_metrics = objective_for(live_args, BatchOptions(), reference)(policy, live_samples)
    read, read_metrics = objective_for(args, BatchOptions(), None)(policy, samples)
    torch.testing.assert_close(read, live, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(read_metrics["margins"], live_metrics["margins"], atol=1e-5, rtol=1e-5)
    assert abs(live.item() - np.log(2)) > 1e-3  # policy and reference differ: the reference terms matter


def kto_args(folder, **overrides):
    data = {f"{split}_{kind}data_paths": [str(folder / f"kto_messages_{kind}document")]
            for split in ("train", "valid") for kind in ("", "label_", "reward_")}
    return make_args(pack_impl="unpacked", seq_length=SEQ, train_impl="kto", padded_vocab_size=128, kto_beta=0.5,
                     **{**data, **overrides})


@pytest.fixture(scope="module")
def kto_data(tmp_path_factory):
    """Scored chats through the preprocess tool (--reward-key): a desirable and an undesirable answer per prompt."""
    folder = tmp_path_factory.mktemp("kto")
    records = [{"messages": chat(prompt, answer), "score": score} for p, c, r in PAIRS
               for prompt, answer, score in ((p, c, 1.0), (p, r, -1.0))]
    run("--input", write_jsonl(folder / "scored.jsonl", records), "--tokenizer-path",
        str(make_chat_tokenizer(folder / "tok")), "--jsonl-keys", "messages", "--reward-key", "score",
        "--output-prefix", str(folder / "kto"))
    return folder


def test_kto_on_precomputed_log_probs_has_the_live_references_loss(kto_data, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(kto_data, folder)
    args = kto_args(folder, precompute_model_name="sft")
    reference = build_model(args.architecture(), seed=1).eval()
    written = write_reference_log_probs(reference, args, 0, logging.getLogger("test"))
    assert written == [reference_log_probs_prefix(str(folder / "kto_messages_document"), "sft")]  # train = valid
    assert all(len(MMapIndexedDataset(written[0])[i]) == SEQ for i in range(len(PAIRS) * 2))

    train, _, _ = build_train_valid_test_datasets(args, (8, 0, 0))
    samples = collated(train, 8)
    assert samples["ref"].dtype == torch.float32 and samples["ref"].shape == samples["text"].shape
    policy = build_model(args.architecture(), seed=2)
    live_samples = {key: value for key, value in samples.items() if key != "ref"}
    live, live_metrics = objective_for(kto_args(folder), BatchOptions(), reference)(policy, live_samples)
    read, read_metrics = objective_for(args, BatchOptions(), None)(policy, samples)
    torch.testing.assert_close(read, live, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(read_metrics["kl"], live_metrics["kl"], atol=1e-6, rtol=1e-5)
    assert abs(live.item() - 0.5) > 1e-3  # policy and reference differ: the reference terms matter


def write_log_probs(prefix, documents: int, length: int, dtype=np.float32) -> None:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for _ in range(documents):
        builder.add_item(np.full(length, -1.0, dtype=dtype))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("documents, length, dtype, says", [
    (None, None, None, "kto_messages_document_sft.bin does not exist"),
    (len(PAIRS) * 2 - 1, SEQ, np.float32, "hold 7 float32 documents of [16] values"),
    (len(PAIRS) * 2, SEQ + 8, np.float32, "hold 8 float32 documents of [24] values"),
    (len(PAIRS) * 2, SEQ, np.int32, "hold 8 int32 documents"),
], ids=["missing", "fewer-documents", "other-seq-length", "not-float32"])
def test_precomputed_files_that_do_not_fit_the_data_are_refused_in_one_line(kto_data, documents, length, dtype,
                                                                             says):
    prefix = reference_log_probs_prefix(str(kto_data / "kto_messages_document"), "sft")
    for path in (f"{prefix}.bin", f"{prefix}.idx"):
        Path(path).unlink(missing_ok=True)
    if documents is not None:
        write_log_probs(prefix, documents, length, dtype)
    with pytest.raises(DataError) as refused:
        build_train_valid_test_datasets(kto_args(kto_data, precompute_model_name="sft"), (8, 0, 0))
    message = str(refused.value)
    assert says in message and "generate.py (text_gen_type: precompute" in message and "\n" not in message
