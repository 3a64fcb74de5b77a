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

from megatron.checkpointing import ReferenceIdentity
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
from megatron.objectives.precomputed_reference import PrecomputeSettings
from tests.e2e.test_preprocess_chat import make_chat_tokenizer, run, write_jsonl
from tests.unit.test_data_gpt_dataset import make_args

pytestmark = pytest.mark.usefixtures("single_rank_world")

SEQ = 16
IDENTITY = ReferenceIdentity("/models/sft", None, "0123456789abcdef")  # the weights of the models built in-process
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
    written = write_reference_log_probs(reference, PrecomputeSettings.from_args(args), IDENTITY, 0, logging.getLogger("test"))
    assert written == [reference_log_probs_prefix(str(tmp_path / f"dpo_{side}_document"), "sft")
                       for side in ("chosen", "rejected")]
    stored = MMapIndexedDataset(written[0])
    chosen = MMapIndexedDataset(tmp_path / "dpo_chosen_document")
    assert stored.dtype == np.float32 and len(stored) == len(chosen)
    assert all(len(stored[i]) == SEQ for i in range(len(stored)))
    assert write_reference_log_probs(reference, PrecomputeSettings.from_args(args), IDENTITY, 0, logging.getLogger("test")) == []  # kept, not rewritten

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
    written = write_reference_log_probs(reference, PrecomputeSettings.from_args(args), IDENTITY, 0, logging.getLogger("test"))
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


# --- the identity of the model that wrote them ----------------------------------------------------------------

def hf_dpo_run(folder, hf_dir, **overrides):
    """A DPO fine-tune of the Hugging Face model in `hf_dir` on precomputed log-probabilities (data as dpo_args)."""
    from tests.e2e.test_hf_conversion import our_args

    data = {f"{sign}_{split}_{kind}data_paths": [str(folder / f"dpo_{key}_{kind}document")]
            for split in ("train", "valid") for sign, key in (("pos", "chosen"), ("neg", "rejected"))
            for kind in ("", "label_")}
    return our_args(hf_dir, load=str(hf_dir), finetune=True, dataset_impl="pairwise", pack_impl="unpacked",
                    seq_length=SEQ, train_impl="dpo", precompute_model_name="sft", train_micro_batch_size_per_gpu=2,
                    optimizer={"type": "Adam", "params": {"lr": 1e-3}}, **{**data, **overrides})


@pytest.fixture
def two_models(tmp_path):
    """Chosen/rejected data and two Hugging Face models of the same shape with other weights."""
    from tests.e2e.test_hf_conversion import make_hf_model, save_hf

    tokenizer = make_chat_tokenizer(tmp_path / "tok")
    records = [{"chosen": chat(p, c), "rejected": chat(p, r)} for p, c, r in PAIRS]
    run("--input", write_jsonl(tmp_path / "pairs.jsonl", records), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "chosen", "rejected", "--output-prefix", str(tmp_path / "dpo"))
    return [save_hf(make_hf_model("llama_gqa", seed=seed), tmp_path / f"model_{seed}") for seed in (1, 2)]


def precompute_from(hf_dir, args) -> list[str]:
    """What generate.py's text_gen_type precompute does with `load` naming `hf_dir`."""
    from megatron.checkpointing import LoadSettings
    from megatron.hf import HF_FOLDER
    from megatron.hf.folder_weights import load_hf_module_weights
    from megatron.objectives.precomputed_reference import identity_of_load

    model = build_model(args.architecture(), seed=0).eval()
    model.load_state_dict(load_hf_module_weights(hf_dir, args.architecture()))
    identity = identity_of_load(LoadSettings.from_args(args), 1, HF_FOLDER)
    return write_reference_log_probs(model, PrecomputeSettings.from_args(args), identity, 0, logging.getLogger("test"))


def check_at_start(args):
    from megatron.checkpointing import LoadSettings, plan_load
    from megatron.hf import HF_FOLDER
    from megatron.objectives.precomputed_reference import precomputed_reference

    return precomputed_reference(PrecomputeSettings.from_args(args), LoadSettings.from_args(args),
                                 plan_load(args, 1, hf_source=HF_FOLDER), 1, hf_source=HF_FOLDER)


def test_a_run_refuses_log_probabilities_another_model_precomputed(tmp_path, two_models):
    first, second = two_models
    written = precompute_from(first, hf_dpo_run(tmp_path, first, text_gen_type="precompute"))
    assert len(written) == 2 and all(Path(f"{target}.reference.json").is_file() for target in written)
    identity = check_at_start(hf_dpo_run(tmp_path, first))  # the model the run starts from: its reference
    assert identity.source == str(first)
    with pytest.raises(DataError) as refused:
        check_at_start(hf_dpo_run(tmp_path, second))
    message = str(refused.value)
    assert f"{written[0]}.bin/.idx hold the log-probabilities of {first}" in message
    assert f"this run's reference model is {second}" in message and "\n" not in message


def test_log_probabilities_that_record_no_model_are_refused(tmp_path, two_models):
    first, _ = two_models
    written = precompute_from(first, hf_dpo_run(tmp_path, first, text_gen_type="precompute"))
    Path(f"{written[1]}.reference.json").unlink()  # as GPT-NeoX writes them
    with pytest.raises(DataError, match="a model they do not record"):
        check_at_start(hf_dpo_run(tmp_path, first))


def test_a_second_precompute_into_the_name_keeps_its_own_files_and_replaces_another_models_only_when_asked(
        tmp_path, two_models):
    first, second = two_models
    written = precompute_from(first, hf_dpo_run(tmp_path, first, text_gen_type="precompute"))
    before = [Path(f"{target}.bin").read_bytes() for target in written]
    assert precompute_from(first, hf_dpo_run(tmp_path, first, text_gen_type="precompute")) == []  # kept
    with pytest.raises(DataError) as refused:
        precompute_from(second, hf_dpo_run(tmp_path, second, text_gen_type="precompute"))
    message = str(refused.value)
    assert f"hold the log-probabilities of {first}" in message and "set precompute_overwrite: true" in message
    assert [Path(f"{target}.bin").read_bytes() for target in written] == before  # nothing lost
    assert precompute_from(second, hf_dpo_run(tmp_path, second, text_gen_type="precompute",
                                              precompute_overwrite=True)) == written
    assert [Path(f"{target}.bin").read_bytes() for target in written] != before
    assert check_at_start(hf_dpo_run(tmp_path, second)).source == str(second)


def test_dry_run_refuses_log_probabilities_another_model_precomputed_as_the_start_does(tmp_path, capsys):
    import deepy
    from tests.e2e.test_dry_run import RANK_ECHO
    from tests.e2e.test_hf_conversion import make_hf_model, save_hf
    from tests.unit.test_data_gpt_dataset import write_documents
    from tests.unit.test_neox_args import write_yaml

    first, second = (save_hf(make_hf_model("llama_gqa", seed=seed), tmp_path / f"model_{seed}", tokenizer=True)
                     for seed in (1, 2))
    documents = [np.arange(3, 3 + length) for length in (5, 9, 12, 7)]
    for key in ("chosen", "rejected"):
        write_documents(tmp_path / f"dpo_{key}_document", documents)
        write_documents(tmp_path / f"dpo_{key}_label_document", documents, np.int32)
    precompute_from(first, hf_dpo_run(tmp_path, first, text_gen_type="precompute"))
    run_settings = {name: value for name, value in hf_dpo_run(tmp_path, first).given.items()
                    if name in ("finetune", "dataset_impl", "pack_impl", "train_impl", "precompute_model_name",
                                "train_micro_batch_size_per_gpu", "optimizer", "train_iters", "seq_length")
                    or name.endswith("_data_paths")}

    def dry_run(hf_dir) -> tuple[int, list[str]]:
        config = write_yaml(tmp_path, "dpo.yml", {**run_settings, "load": str(hf_dir), "eval_iters": 0})
        status = deepy.main([RANK_ECHO, str(config), "--dry-run"])
        return status, [line for line in capsys.readouterr().err.splitlines() if line.startswith("deepy.py:")]

    status, errors = dry_run(second)
    assert status == 2 and len(errors) == 1
    assert f"hold the log-probabilities of {first}" in errors[0] and f"reference model is {second}" in errors[0]
    assert dry_run(first) == (0, [])
