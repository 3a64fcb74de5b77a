"""End to end, as a GPT-NeoX user runs KTO (post-training/configs/llama3-8b-kto.yml, scaled down): chats with a
score through the preprocess tool (`--reward-key`), KTO from a Hugging Face Llama folder on 2 ranks, saved and
resumed against the reference the run started from, and run again on the reference's log-probabilities
precomputed by generate.py (precompute_model_name) with the live reference's lines."""

from __future__ import annotations

import re

import pytest

from tests.deepy_runs import run_deepy, write_overrides
from tests.e2e.test_dpo import CHOSEN, PROMPTS, REJECTED, chat, save_llama
from tests.e2e.test_preprocess_chat import make_chat_tokenizer, run, write_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KTO_LINE = re.compile(r"iteration\s+(\d+)/\d+ \| loss ([\d.]+) \| kl (-?[\d.]+) \| reward_acc ([\d.]+)")


def kto_lines(output: str) -> dict[int, tuple[float, ...]]:
    lines = {int(m[1]): tuple(float(v) for v in m.groups()[1:]) for m in KTO_LINE.finditer(output)}
    assert lines, f"no KTO iteration lines in the output:\n{output[-4000:]}"
    return lines


def test_kto_from_a_hf_folder_learns_the_desirable_answers_and_resumes_against_the_same_reference(tmp_path):
    tokenizer = make_chat_tokenizer(tmp_path / "tok", eos="<|endoftext|>")
    records = [{"messages": chat(prompt, answer), "score": score}
               for _ in range(4) for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)
               for prompt, answer, score in ((p, c, 1.0), (p, r, -1.0))]
    run("--input", write_jsonl(tmp_path / "scored.jsonl", records), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "messages", "--reward-key", "score", "--output-prefix", str(tmp_path / "kto"))
    hf_dir = tmp_path / "hf"
    save_llama(hf_dir, seed=0)
    data = {f"{split}_{kind}paths": [str(tmp_path / f"kto_messages_{kind.replace('data_', '')}document")]
            for split in ("train", "valid") for kind in ("data_", "label_data_", "reward_data_")}
    settings = dict(
        load=str(hf_dir), finetune=True, save=str(tmp_path / "run"), train_impl="kto", kto_beta=0.5,
        pack_impl="unpacked", **data, tokenizer_type="HFTokenizer", vocab_file=str(tokenizer / "tokenizer.json"),
        seq_length=24, num_gpus=2, train_micro_batch_size_per_gpu=4, precision="fp32",
        zero_optimization={"stage": 1}, optimizer={"type": "Adam", "params": {"lr": 0.01}},
        train_iters=4, checkpoint_factor=2, eval_interval=2, eval_iters=1, num_workers=0)
    unbroken = run_deepy([write_overrides(tmp_path, name="kto.yml", **settings)]).stdout
    assert f"reference model: {hf_dir} (the model this fine-tune starts from)" in unbroken
    lines = kto_lines(unbroken)
    loss, kl, accuracy = lines[1]
    # the policy is the reference at the first step: every log-ratio is 0, so each sample's loss is 1 - sigmoid(0)
    assert (loss, kl, accuracy) == (0.5, 0.0, 0.0)
    # it learns which answers are desirable; not step by step, since the reference point z moves with each batch
    assert lines[4][0] < loss - 0.05 and lines[4][2] > 0, lines
    assert "validation at iteration 2: loss" in unbroken and "reward_acc" in unbroken.split("validation")[1]

    # the reference's log-probabilities written once by generate.py, `load` naming the reference; then KTO
    # builds no reference model and prints the live reference's lines
    precompute = {**settings, "save": None, "num_gpus": 1, "text_gen_type": "precompute",
                  "precompute_model_name": "hf_reference"}
    run_deepy([write_overrides(tmp_path, name="precompute.yml", **precompute)], script="generate.py")
    assert (tmp_path / "kto_messages_document_hf_reference.bin").is_file()
    precomputed = run_deepy([write_overrides(tmp_path, name="precomputed.yml", **{
        **settings, "save": None, "eval_interval": 100, "precompute_model_name": "hf_reference"})]).stdout
    assert "reference model:" not in precomputed
    read = kto_lines(precomputed)
    assert read.keys() == lines.keys()
    for step, values in read.items():  # the lines' 4 decimals, up to a rounding of fp32 sums in another order
        assert values == pytest.approx(lines[step], abs=2e-4), (step, values, lines[step])

    resume = {**settings, "load": str(tmp_path / "run"), "finetune": False, "iteration": 2,
              "save": str(tmp_path / "resumed")}
    resumed = run_deepy([write_overrides(tmp_path, name="resume.yml", **resume)]).stdout
    assert f"reference model: {hf_dir} (recorded by the checkpoint this run resumes)" in resumed
    assert kto_lines(resumed) == {i: lines[i] for i in (3, 4)}  # the reference is the folder, not the resumed policy
