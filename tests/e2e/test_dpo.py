"""End to end, as a GPT-NeoX user runs DPO (post-training/configs/llama3-8b-dpo.yml, scaled down): chosen and
rejected chats through the preprocess tool, DPO from a Hugging Face Llama folder on 2 ranks, stopped by a SIGTERM
to every process of the job (a checkpoint), resumed, and under ZeRO-3 (the reference partitioned like the policy)
with ZeRO-1's losses.
The reference stays the folder the run started from: the resumed run's losses are the unbroken run's (GPT-NeoX
reloads its reference from the resumed policy, and its loss falls back to ln 2), and a resume whose recorded
reference is gone or changed is refused in one line."""

from __future__ import annotations

import math
import re
import shutil
import signal

import pytest

from megatron.runtime import faults
from tests.deepy_runs import run_deepy, write_overrides
from tests.e2e.test_preprocess_chat import make_chat_tokenizer, run, write_jsonl
from tests.e2e.test_signals import DeepyRun, assert_graceful_stop, signal_the_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DPO_LINE = re.compile(r"iteration\s+(\d+)/\d+ \| loss ([\d.]+) \| chosen_rewards (-?[\d.]+) \| "
                      r"rejected_rewards (-?[\d.]+) \| reward_acc ([\d.]+) \| margins (-?[\d.]+)")
PROMPTS = ["hi", "what is two plus four", "hello", "bye", "be kind", "what is two"]
CHOSEN = ["hello there", "four", "hi there", "bye bye", "ok", "two"]
REJECTED = ["bye", "two plus two", "what", "ok ok", "be", "four plus four"]


def chat(prompt: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def dpo_lines(output: str) -> dict[int, tuple[float, ...]]:
    lines = {int(m[1]): tuple(float(v) for v in m.groups()[1:]) for m in DPO_LINE.finditer(output)}
    assert lines, f"no DPO iteration lines in the output:\n{output[-4000:]}"
    return lines


def save_llama(folder, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(folder)


def dpo_run(tmp_path) -> tuple[dict, object]:
    """(settings, HF folder) of a DPO fine-tune from a tiny Llama folder on 2 ranks, on chats made by the
    preprocess tool."""
    tokenizer = make_chat_tokenizer(tmp_path / "tok", eos="<|endoftext|>")
    records = [{"chosen": chat(p, c), "rejected": chat(p, r)}
               for _ in range(4) for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)]
    run("--input", write_jsonl(tmp_path / "pairs.jsonl", records), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "chosen", "rejected", "--output-prefix", str(tmp_path / "dpo"))
    hf_dir = tmp_path / "hf"
    save_llama(hf_dir, seed=0)
    data = {f"{sign}_{split}_{kind}paths": [str(tmp_path / f"dpo_{side}_{kind.replace('data_', '')}document")]
            for sign, side in (("pos", "chosen"), ("neg", "rejected")) for split in ("train", "valid")
            for kind in ("data_", "label_data_")}
    settings = dict(
        load=str(hf_dir), finetune=True, save=str(tmp_path / "run"), train_impl="dpo", dpo_beta=0.5,
        dataset_impl="pairwise", pack_impl="unpacked", **data, tokenizer_type="HFTokenizer",
        vocab_file=str(tokenizer / "tokenizer.json"), seq_length=24, num_gpus=2, train_micro_batch_size_per_gpu=2,
        precision="fp32", zero_optimization={"stage": 1}, optimizer={"type": "Adam", "params": {"lr": 0.01}},
        train_iters=4, checkpoint_factor=2, eval_interval=2, eval_iters=1, num_workers=0)
    return settings, hf_dir


def test_dpo_resumed_from_its_save_still_compares_against_the_model_it_started_from(tmp_path):
    settings, hf_dir = dpo_run(tmp_path)
    unbroken = run_deepy([write_overrides(tmp_path, name="dpo.yml", **settings)]).stdout
    assert f"reference model: {hf_dir} (the model this fine-tune starts from)" in unbroken
    lines = dpo_lines(unbroken)
    loss, chosen, rejected, accuracy, margins = lines[1]
    assert loss == pytest.approx(math.log(2), abs=1e-4)  # the policy is the reference at the first step
    assert (chosen, rejected, accuracy, margins) == (0.0, 0.0, 0.0, 0.0)
    assert all(lines[i][0] < loss - 0.05 for i in (2, 3, 4))  # it learns to prefer the chosen answers
    assert "validation at iteration 2: loss" in unbroken and "chosen_rewards" in unbroken.split("validation")[1]

    # ZeRO-3: the reference is partitioned like the policy, and every step's line is ZeRO-1's (fp32, 4 decimals)
    zero3 = {**settings, "zero_optimization": {"stage": 3}, "save": None}
    assert dpo_lines(run_deepy([write_overrides(tmp_path, name="zero3.yml", **zero3)]).stdout) == lines

    # SIGTERM to every process of the job after step 1 (each rank waits there for it): a checkpoint, exit 0
    stopped_save = tmp_path / "stopped"
    job = DeepyRun([write_overrides(tmp_path, name="stopped.yml", **{**settings, "save": str(stopped_save)})],
                   extra_env=faults.switched_on(hold_after_iteration=1))
    job.wait_for(r"iteration\s+1/4")
    signal_the_job(job, "every process", signal.SIGTERM)
    assert assert_graceful_stop(job, stopped_save, signal.SIGTERM, ranks=2) == 1
    assert dpo_lines(job.output) == {1: lines[1]}

    resume = {**settings, "load": str(stopped_save), "finetune": False, "save": str(tmp_path / "resumed")}
    resumed = run_deepy([write_overrides(tmp_path, name="resume.yml", **resume)]).stdout
    assert f"reference model: {hf_dir} (recorded by the checkpoint this run resumes)" in resumed
    assert dpo_lines(resumed) == {i: lines[i] for i in (2, 3, 4)}  # not ln 2 again: the reference is the folder

    save_llama(hf_dir, seed=1)  # the folder now holds another model
    changed = run_deepy([write_overrides(tmp_path, name="changed.yml", **resume)], expect_success=False)
    assert changed.returncode != 0 and "changed since the run started" in changed.stdout + changed.stderr
    assert "Traceback" not in changed.stdout + changed.stderr
    shutil.rmtree(hf_dir)
    gone = run_deepy([write_overrides(tmp_path, name="gone.yml", **resume)], expect_success=False)
    assert gone.returncode != 0 and f"{hf_dir} (recorded in {stopped_save / 'global_step1'}), is gone" in \
        gone.stdout + gone.stderr


def test_dpo_with_lora_compares_against_its_own_base_and_resumes_with_the_unbroken_losses(tmp_path):
    settings, hf_dir = dpo_run(tmp_path)
    lora = {**settings, "num_gpus": 1, "lora_rank": 4, "lora_alpha": 8, "lora_target_modules": "all-linear",
            "optimizer": {"type": "Adam", "params": {"lr": 0.05}}, "save": str(tmp_path / "unbroken")}
    unbroken = run_deepy([write_overrides(tmp_path, name="lora.yml", **lora)]).stdout
    assert (f"reference model: {hf_dir} (the model this fine-tune starts from), this run's own frozen base with its "
            "LoRA adapters switched off, no second model in memory") in unbroken
    lines = dpo_lines(unbroken)
    assert lines[1][0] == pytest.approx(math.log(2), abs=1e-4) and lines[1][1:] == (0.0, 0.0, 0.0, 0.0)
    # a reference that moved with the adapters would keep every reward at 0 and the loss at ln 2
    assert lines[2][0] < lines[1][0] and all(lines[i][1] != 0.0 and lines[i][2] != 0.0 for i in (2, 3, 4)), lines

    saved = tmp_path / "at_step_2"  # the unbroken run's save at step 2, as a copy of it someone resumes
    saved.mkdir()
    shutil.copytree(tmp_path / "unbroken" / "global_step2", saved / "global_step2")
    (saved / "latest").write_text("global_step2")
    resume = {**lora, "load": str(saved), "finetune": False, "save": str(tmp_path / "resumed")}
    resumed = run_deepy([write_overrides(tmp_path, name="lora_resume.yml", **resume)]).stdout
    assert f"reference model: {hf_dir} (recorded by the checkpoint this run resumes)" in resumed
    assert dpo_lines(resumed) == {i: lines[i] for i in (3, 4)}

    save_llama(hf_dir, seed=1)  # the base the adapters were trained against is not the folder's any more
    changed = run_deepy([write_overrides(tmp_path, name="lora_changed.yml", **resume)], expect_success=False)
    assert changed.returncode != 0 and "changed since the run started" in changed.stdout + changed.stderr


def test_packed_dpo_starts_at_ln_2_and_learns(tmp_path):
    """Several pairs to a row (pack_until_overflow, no document seeing another): the policy is the reference at
    the first step, so every pair's term, and their mean, is ln 2 exactly as unpacked; then it learns."""
    settings, _ = dpo_run(tmp_path)
    packed = {**settings, "pack_impl": "pack_until_overflow", "reset_attention_mask": True,
              "reset_position_ids": True, "seq_length": 64, "train_micro_batch_size_per_gpu": 1, "save": None,
              "checkpoint_factor": None, "eval_interval": 4}
    output = run_deepy([write_overrides(tmp_path, name="packed.yml", **packed)]).stdout
    assert "block-causal per packed document (reset_attention_mask)" in output
    lines = dpo_lines(output)
    assert lines[1][0] == pytest.approx(math.log(2), abs=1e-4) and lines[1][1:] == (0.0, 0.0, 0.0, 0.0)
    assert all(lines[i][0] < lines[1][0] - 0.05 for i in (3, 4)), lines
