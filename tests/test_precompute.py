"""precompute_model_name: generate.py's text_gen_type precompute writes the reference's log-probabilities in
GPT-NeoX's layout ({data prefix}_{name}.bin/.idx, float32, one seq_length document per document), and DPO
reading them has the loss of DPO running the reference live."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from megatron.data import BatchOptions, DataError, MMapIndexedDataset, build_train_valid_test_datasets
from megatron.data.builders import reference_log_probs_prefix
from megatron.generation.precompute import write_reference_log_probs
from megatron.model import build_model
from megatron.objectives import objective_for
from tests.test_data_gpt_dataset import make_args
from tests.test_preprocess_chat import make_chat_tokenizer, run, write_jsonl

pytestmark = pytest.mark.usefixtures("single_rank_world")

SEQ = 16
PAIRS = [("hi", "hello there", "bye"), ("what is two plus four", "four", "two plus two"),
         ("hello", "hi there", "what"), ("bye", "bye bye", "ok ok")]


def chat(prompt: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


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
    samples = {key: torch.as_tensor(value) for key, value in default_collate([train[i] for i in range(4)]).items()}
    assert {"pos_ref", "neg_ref"} <= samples.keys()
    policy = build_model(args.architecture(), seed=2)
    live_args = dpo_args(tmp_path)
    live_samples = {key: value for key, value in samples.items() if not key.endswith("_ref")}
    live, live_metrics = objective_for(live_args, BatchOptions(), reference)(policy, live_samples)
    read, read_metrics = objective_for(args, BatchOptions(), None)(policy, samples)
    torch.testing.assert_close(read, live, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(read_metrics["margins"], live_metrics["margins"], atol=1e-5, rtol=1e-5)
    assert abs(live.item() - np.log(2)) > 1e-3  # policy and reference differ: the reference terms matter
