"""End to end, REINFORCE scored by a reward model made here: a train_impl rm run from a Hugging Face Llama folder
saves the reward model; a REINFORCE run from the same folder names it as `reward_model`, trains two steps and logs
its rollouts. Every logged reward is the reward model's scalar computed independently (the tag exported to a
transformers LlamaForSequenceClassification, which reads the score at the last token: the end-of-text token after
the completion, where the rm objective reads it); the samples shown every log_interval are the logged ones; a
reward model that is missing, not a reward model, or not the one a resumed save recorded is one line."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch

from megatron.checkpointing import CheckpointError, LoadSettings, plan_load, plan_reward_model
from megatron.hf import HF_FOLDER
from megatron.hf.convert import convert_neox_to_hf
from megatron.launch.run_context import resolve_run_settings, settings_for_run
from tests.deepy_runs import run_deepy, write_overrides
from tests.e2e.test_dpo import CHOSEN, PROMPTS, REJECTED, chat
from tests.e2e.test_preprocess_chat import run, write_jsonl
from tests.e2e.test_reinforce import reinforce_settings
from tests.e2e.test_reward_model import tokenizer_pad_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHOWN = re.compile(r"rollout sample (\d+) of iteration (\d+) \| reward (-?[\d.]+) \| prompt (.*) \| completion (.*)")


def make_reward_model(tmp_path, tokenizer) -> None:
    """A reward model trained one step from tmp_path/hf on chosen/rejected chats, saved in tmp_path/rm."""
    records = [{"chosen": chat(p, c), "rejected": chat(p, r)} for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)]
    run("--input", write_jsonl(tmp_path / "pairs.jsonl", records), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "chosen", "rejected", "--for-rm", "--output-prefix", str(tmp_path / "pairs"))
    paths = {f"{sign}_train_{kind}data_paths": [str(tmp_path / f"pairs_{key}_{kind}document")]
             for sign, key in (("pos", "chosen"), ("neg", "rejected")) for kind in ("", "label_")}
    config = write_overrides(
        tmp_path, name="rm.yml", load=str(tmp_path / "hf"), finetune=True, save=str(tmp_path / "rm"),
        tokenizer_type="HFTokenizer", vocab_file=str(tokenizer / "tokenizer.json"), seq_length=24, train_impl="rm",
        dataset_impl="pairwise", pack_impl="unpacked", num_gpus=1, train_micro_batch_size_per_gpu=2,
        precision="fp32", optimizer={"type": "Adam", "params": {"lr": 0.01}}, train_iters=1, eval_interval=100,
        eval_iters=0, num_workers=0, **paths)
    run_deepy([config])


def test_reinforce_scored_by_a_reward_model_tag(tmp_path):
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    settings = reinforce_settings(tmp_path, reward_function=None, reward_model=str(tmp_path / "rm"),
                                  reinforce_advantage="group_normalized", kl_div_beta=0.0, rollout_samples_shown=2,
                                  save=str(tmp_path / "policy"), tensorboard_dir=None)
    make_reward_model(tmp_path, tmp_path / "tok")
    output = run_deepy([write_overrides(tmp_path, name="rl.yml", **settings)]).stdout
    assert f"reward model: {tmp_path / 'rm' / 'global_step1'}, weights only" in output
    records = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 8 and len({r["reward"] for r in records}) > 1

    convert_neox_to_hf(tmp_path / "rm", tmp_path / "rm_hf", pad_token_id=tokenizer_pad_id(tmp_path / "tok"))
    scorer = LlamaForSequenceClassification.from_pretrained(tmp_path / "rm_hf", torch_dtype=torch.float32).eval()
    eos = AutoTokenizer.from_pretrained(tmp_path / "tok").eos_token_id
    with torch.no_grad():
        for record in records:
            # --for-rm chats end with two eos and the rm objective reads the first: the eos ending the completion
            ids = record["prompt_ids"] + record["completion_ids"] + ([] if record["completion_ids"][-1:] == [eos]
                                                                     else [eos])
            score = scorer(input_ids=torch.tensor([ids])).logits[0, 0].item()
            assert record["reward"] == pytest.approx(score, abs=1e-4), record

    shown = [m.groups() for m in SHOWN.finditer(output)]
    assert [(int(n), int(i)) for n, i, *_ in shown] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    for (number, iteration, reward, prompt, completion) in shown:
        logged = [r for r in records if r["iteration"] == int(iteration)][int(number) - 1]
        assert (float(reward), prompt, completion) == (round(logged["reward"], 4), repr(logged["prompt"]),
                                                       repr(logged["completion"]))

    args = resolve_run_settings(settings_for_run([str(tmp_path / "rl.yml")]))
    architecture = dataclasses.replace(args.architecture(), reward_head=True)
    load = LoadSettings.from_args(args)
    with pytest.raises(CheckpointError, match=r"reward_model .*missing does not exist"):
        plan_reward_model(load, str(tmp_path / "missing"), architecture, args.tokenizer_type, None, 1, HF_FOLDER)
    with pytest.raises(CheckpointError, match=r"is not a reward model \(its tag global_step2 was saved by train_impl "
                                              r"'reinforce'"):
        plan_reward_model(load, str(tmp_path / "policy"), architecture, args.tokenizer_type, None, 1, HF_FOLDER)

    # a resume of the policy's tag with another reward model (a copy: same weights, another source) is refused
    shutil.copytree(tmp_path / "rm", tmp_path / "rm_copy")
    resume = resolve_run_settings(settings_for_run([str(write_overrides(tmp_path, name="resume.yml", **{
        **settings, "load": str(tmp_path / "policy"), "finetune": False, "train_iters": 3}))]))
    policy_plan = plan_load(resume, 1, hf_source=HF_FOLDER)
    load = LoadSettings.from_args(resume)
    plan_reward_model(load, str(tmp_path / "rm"), architecture, args.tokenizer_type, policy_plan, 1, HF_FOLDER)
    with pytest.raises(CheckpointError, match="was trained with the reward model .*rm/global_step1.* a resume scores "
                                              "with the same reward model"):
        plan_reward_model(load, str(tmp_path / "rm_copy"), architecture, args.tokenizer_type, policy_plan, 1,
                          HF_FOLDER)
