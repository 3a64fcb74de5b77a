"""A supervised fine-tune in the real training loop (single rank, real DeepSpeed engine): chats through
the preprocess tool, label files, unpacked samples; the loss the run reports is the masked loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.data import build_data_iterators, build_train_valid_test_datasets
from megatron.data.builders import samples_per_split
from megatron.data.data_settings import DataSettings
from megatron.launch.run_context import resolve_run_settings
from megatron.model import build_model
from megatron.neox_arguments import NeoXArgs
from megatron.training.loop import missing_evaluation_notes, setup, train
from megatron.training.loop_settings import LoopSettings
from tests.e2e.test_preprocess_chat import CHAT, make_chat_tokenizer, run, write_jsonl

pytestmark = pytest.mark.usefixtures("single_rank_world")


def masked_loss(model, samples: list[dict]) -> float:
    """The token mean of the cross entropy over the targets whose label is not negative, written out."""
    text = torch.stack([torch.as_tensor(s["text"]) for s in samples])
    label = torch.stack([torch.as_tensor(s["label"]) for s in samples])[:, 1:]
    with torch.no_grad():
        logits = model(text[:, :-1]).float()
    trained = label >= 0
    return F.cross_entropy(logits[trained], label[trained]).item()


def sft_args(tmp_path, **overrides):
    """A one-step SFT run on chats through the preprocess tool, evaluated after its step."""
    tokenizer = make_chat_tokenizer(tmp_path / "tok", eos="<|endoftext|>")  # HFTokenizer's end of document
    chats = [{"messages": CHAT[: 3 + (i % 3)]} for i in range(24)]
    run("--input", write_jsonl(tmp_path / "chats.jsonl", chats), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "messages", "--output-prefix", str(tmp_path / "sft"))
    tokens, labels = str(tmp_path / "sft_messages_document"), str(tmp_path / "sft_messages_label_document")
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=24, train_iters=1,
                  optimizer={"type": "Adam", "params": {"lr": 1e-12}}, warmup=0, train_micro_batch_size_per_gpu=2,
                  tokenizer_type="HFTokenizer", vocab_file=str(tokenizer / "tokenizer.json"),
                  train_data_paths=[tokens], valid_data_paths=[tokens], test_data_paths=[tokens],
                  train_label_data_paths=[labels], valid_label_data_paths=[labels], test_label_data_paths=[labels],
                  pack_impl="unpacked", allow_chopped=False, eval_interval=1, eval_iters=1, log_interval=1,
                  num_workers=0, precision="fp32", zero_optimization={"stage": 1})
    return resolve_run_settings(NeoXArgs.from_dict({**values, **overrides}, require_run_settings=True))


def test_sft_run_trains_and_evaluates_only_the_labelled_tokens(tmp_path):
    args = sft_args(tmp_path)
    engine, state, iterators = setup(args)
    result = train(args, engine, state, iterators)
    # lr 1e-12: the weights stay (to 1e-5) those drawn from the seed, so each loss is the masked loss of its samples
    model = build_model(args.architecture(), args.seed).eval()
    train_data, valid_data, _ = build_train_valid_test_datasets(args, samples_per_split(DataSettings.from_args(args)))
    assert result.last_train_loss == pytest.approx(masked_loss(model, [train_data[0], train_data[1]]), rel=1e-5)
    assert result.last_valid_loss == pytest.approx(masked_loss(model, [valid_data[0], valid_data[1]]), rel=1e-5)
    everything = [{**s, "label": s["text"]} for s in (train_data[0], train_data[1])]
    assert abs(result.last_train_loss - masked_loss(model, everything)) > 1e-3
    assert result.test_loss == pytest.approx(result.last_valid_loss, rel=1e-5)  # the same files, the same samples


def test_an_evaluation_reads_eval_iters_batches_of_gradient_accumulation_micro_batches(tmp_path):
    """GPT-NeoX's evaluate runs eval_iters x gradient_accumulation_steps micro batches (a batch as the
    pipeline engine counts it): here 1 x 2 micro batches of 1 sample, the mean of their two losses."""
    args = sft_args(tmp_path, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2)
    engine, state, iterators = setup(args)
    result = train(args, engine, state, iterators)
    model = build_model(args.architecture(), args.seed).eval()
    _, valid_data, _ = build_train_valid_test_datasets(args, samples_per_split(DataSettings.from_args(args)))
    per_sample = [masked_loss(model, [valid_data[i]]) for i in range(2)]
    assert per_sample[0] != pytest.approx(per_sample[1], rel=1e-3)  # the two samples tell the counts apart
    assert result.last_valid_loss == pytest.approx(sum(per_sample) / 2, rel=1e-5)
    assert state.consumed_valid_samples == 2  # where the next evaluation starts: after both


def test_a_run_without_validation_data_says_it_will_not_evaluate(tmp_path):
    args = sft_args(tmp_path, valid_data_paths=None, valid_label_data_paths=None)
    _, valid, test = build_data_iterators(args, samples_per_split(DataSettings.from_args(args)), 0, 1)
    assert valid is None and test is not None
    assert missing_evaluation_notes(LoopSettings.from_args(args), valid, test) == [
        "no validation data (valid_data_paths is not set): no evaluation every 1 steps"]
