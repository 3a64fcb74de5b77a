"""End to end, REINFORCE as a GPT-NeoX user runs it, from a Hugging Face Llama folder: chats through the preprocess
tool give the prompts, the policy samples completions, a reward function in a file scores them. The first step
(SGD) is checked against autograd on the transformers model, computed from the rollouts the run logged: the
logged log-probabilities are the model's, the loss line is GPT-NeoX's loss, and the second step's logged
log-probabilities are those of the transformers model moved by that gradient.

Runs (10 deepy runs): one per advantage mode and layout of the autograd check (ZeRO-3 samples from a whole copy of
the partitioned policy, megatron/rollouts/sampler_model.py); one LoRA run, checked for its
reference and also the unbroken run whose step 2 tag one resume starts from; the learning run; one data-server
run per layout and one refused data-server run (at TP 2, where the refusal is also handed between ranks)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.deepy_runs import run_deepy, tensorboard_scalars, write_overrides
from tests.e2e.test_dpo import PROMPTS, chat, save_llama
from tests.e2e.test_preprocess_chat import make_chat_tokenizer, run, write_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ANSWERS = ["hello there", "four", "hi there", "bye bye", "ok", "two"]
LINE = re.compile(r"iteration\s+(\d+)/\d+ \| loss (-?[\d.]+)")
REWARD_FILE = '''
def two_count(prompts, completions, completion_ids, **kwargs):
    # the texts' share of "two", and a part that differs between any two completions almost surely
    return [text.split().count("two") / max(len(text.split()), 1) + 0.1 * (sum(ids) % 7) for text, ids in
            zip(completions, completion_ids)]
'''


def reinforce_settings(tmp_path, **overrides) -> dict:
    tokenizer = make_chat_tokenizer(tmp_path / "tok", eos="<|endoftext|>")
    records = [{"messages": chat(p, a)} for _ in range(4) for p, a in zip(PROMPTS, ANSWERS, strict=True)]
    run("--input", write_jsonl(tmp_path / "chats.jsonl", records), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "messages", "--output-prefix", str(tmp_path / "chats"))
    save_llama(tmp_path / "hf", seed=0)
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    settings = dict(
        load=str(tmp_path / "hf"), finetune=True, train_impl="reinforce",
        reward_function=f"{tmp_path / 'rewards.py'}:two_count", reinforce_num_completions=2,
        temperature=1.0, maximum_tokens=6, rollout_log=str(tmp_path / "rollouts.jsonl"),
        pack_impl="unpacked", train_data_paths=[str(tmp_path / "chats_messages_document")],
        train_label_data_paths=[str(tmp_path / "chats_messages_label_document")],
        tokenizer_type="HFTokenizer", vocab_file=str(tokenizer / "tokenizer.json"), seq_length=24, num_gpus=1,
        train_micro_batch_size_per_gpu=2, precision="fp32", optimizer={"type": "SGD", "params": {"lr": 2.0}},
        weight_decay=0.0, gradient_clipping=0.0, hidden_dropout=0.0, attention_dropout=0.0, lr_decay_style="constant",
        warmup=0.0, train_iters=2, eval_interval=100, eval_iters=0, num_workers=0, log_interval=1,
        tensorboard_dir=str(tmp_path / "tb"))
    return {**settings, **overrides}


def hf_log_probs(model, record) -> torch.Tensor:
    """log p of each completion token of a logged rollout under the transformers model."""
    ids = torch.tensor([record["prompt_ids"] + record["completion_ids"]])
    logits = model(ids).logits[0, :-1].float()
    targets = ids[0, 1:]
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0][len(record["prompt_ids"]) - 1:]


def advantages_of(rewards: list[float], mode: str) -> list[float]:
    r = torch.tensor(rewards, dtype=torch.float64)
    if mode == "leave_one_out":
        return [rewards[i] - (sum(rewards) - rewards[i]) / (len(rewards) - 1) for i in range(len(rewards))]
    return ((r - r.mean()) / (r.std() + 1e-4)).tolist()


def rank_records(tmp_path, ranks: int) -> list[list[dict]]:
    """Each data-parallel rank's logged rollouts (rank 0 in rollouts.jsonl, rank r in rollouts.jsonl.rank<r>)."""
    names = ["rollouts.jsonl"] + [f"rollouts.jsonl.rank{r}" for r in range(1, ranks)]
    return [[json.loads(line) for line in (tmp_path / name).read_text().splitlines()] for name in names]


def rank_loss(model, records: list[dict], mode: str, beta: float) -> torch.Tensor:
    """GPT-NeoX's loss of one rank's first micro batch, on the transformers model, from its logged rollouts."""
    trained, per_sample = 0, []
    for group in sorted({r["group"] for r in records}):
        rows = [r for r in records if r["group"] == group]
        for row, advantage in zip(rows, advantages_of([r["reward"] for r in rows], mode), strict=True):
            assert row["advantage"] == pytest.approx(advantage, abs=1e-6)
            lp = hf_log_probs(model, row)
            assert row["logp"] == pytest.approx(lp.sum().item(), abs=1e-4)  # the sampler's log-probs are the model's
            # the reference is the start model: lp - rp is 0 in value, lp's gradient in derivative
            per_sample.append((-lp * advantage + beta * (lp - lp.detach())).sum())
            trained += len(row["completion_ids"])
    return torch.stack(per_sample).sum() / trained / len(per_sample)  # GPT-NeoX: / trained tokens, / samples


# the advantages are computed from the rewards alone (megatron/rollouts/advantages.py), the same on any layout:
# leave_one_out on one rank is covered by rloo-tp2 (the mode) and grpo-1-rank (the layout)
@pytest.mark.parametrize("mode, layout", [("group_normalized", {}),
                                          ("group_normalized", {"num_gpus": 2, "zero_optimization": {"stage": 1},
                                                               "zero_allow_untested_optimizer": True}),
                                          # every parameter partitioned (none kept whole for being small), and
                                          # completions up to seq_length: the ranks' prompts differ in length, so
                                          # do their completions (sampling may run no collective)
                                          ("group_normalized", {"num_gpus": 2, "zero_allow_untested_optimizer": True,
                                                               "zero_optimization": {
                                                                   "stage": 3, "stage3_param_persistence_threshold": 0},
                                                               "maximum_tokens": 24}),
                                          ("leave_one_out", {"num_gpus": 2, "model_parallel_size": 2})],
                         ids=["grpo-1-rank", "grpo-2-ranks-zero1", "grpo-2-ranks-zero3", "rloo-tp2"])
def test_first_reinforce_step_is_autograd_on_the_hf_model_from_the_logged_rollouts(tmp_path, mode, layout):
    from transformers import LlamaForCausalLM

    beta = 0.5
    settings = reinforce_settings(tmp_path, reinforce_advantage=mode, kl_impl="kl", kl_div_beta=beta, **layout)
    output = run_deepy([write_overrides(tmp_path, name="rl.yml", **settings)]).stdout
    assert f"reference model: {tmp_path / 'hf'} (the model this fine-tune starts from)" in output
    losses = {int(m[1]): float(m[2]) for m in LINE.finditer(output)}
    data_parallel = layout.get("num_gpus", 1) // layout.get("model_parallel_size", 1)
    ranks = rank_records(tmp_path, data_parallel)
    assert all(len([r for r in records if r["iteration"] == i]) == 4 for records in ranks for i in (1, 2))
    if "maximum_tokens" in layout:  # the ranks sampled different numbers of tokens, so ran different forwards
        assert len({sum(len(r["completion_ids"]) for r in records) for records in ranks}) == len(ranks), ranks

    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    # DeepSpeed averages the ranks' gradients: the step is that of the mean of the ranks' losses
    loss = torch.stack([rank_loss(model, [r for r in records if r["iteration"] == 1], mode, beta)
                        for records in ranks]).mean()
    assert losses[1] == pytest.approx(loss.item(), abs=2e-4)
    loss.backward()
    second = [r for records in ranks for r in records if r["iteration"] == 2]
    with torch.no_grad():
        before = [hf_log_probs(model, row).sum().item() for row in second]
        for parameter in model.parameters():
            parameter -= 2.0 * parameter.grad
        after = [hf_log_probs(model, row).sum().item() for row in second]
    assert [row["logp"] for row in second] == pytest.approx(after, abs=2e-4)
    assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 1e-2  # the step moved them measurably

    first = [r for records in ranks for r in records if r["iteration"] == 1]
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["train/reward"][1] == pytest.approx(sum(r["reward"] for r in first) / len(first), abs=1e-5)
    assert scalars["train/kl"][1] == 0.0 and {"train/logp", "train/ref_logp", "train/reward_std"} <= set(scalars)

TARGET_FILE = '''
def target_share(prompts, completions, completion_ids, **kwargs):
    return [ids.count({target}) / max(len(ids), 1) for ids in completion_ids]
'''


def test_a_tiny_model_learns_to_say_the_rewarded_token(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.e2e.test_preprocess_chat import SPECIAL, WORDS

    target = (SPECIAL + WORDS).index("two")
    (tmp_path / "target.py").write_text(TARGET_FILE.format(target=target))
    settings = reinforce_settings(
        tmp_path, reinforce_advantage="group_normalized", kl_div_beta=0.0, reinforce_num_completions=4,
        reward_function=f"{tmp_path / 'target.py'}:target_share", train_micro_batch_size_per_gpu=4,
        optimizer={"type": "Adam", "params": {"lr": 0.03}}, train_iters=10, rollout_log=None, maximum_tokens=4,
        make_vocab_size_divisible_by=32)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "hf")
    run_deepy([write_overrides(tmp_path, name="learn.yml", **settings)])
    rewards = tensorboard_scalars(tmp_path / "tb")["train/reward"]
    first, last = (sum(rewards[i] for i in steps) / 3 for steps in (range(1, 4), range(8, 11)))
    assert last > first + 0.3, rewards  # measured: 0.06 0.03 0.09 0.15 0.31 0.50 0.76 0.73 0.95 0.98


def test_with_lora_the_reference_is_the_base_and_a_resume_from_the_step_2_tag_repeats_the_unbroken_run(tmp_path):
    """One LoRA run of 4 steps saving every 2: its reference is its own base with the adapters off; a resume from
    its step 2 tag repeats its rollouts and losses (the sampler's generator, the moving-average baseline, the
    adapters and their optimizer state all restored)."""
    import shutil

    settings = reinforce_settings(tmp_path, reinforce_advantage="moving_average", kl_impl="mse", kl_div_beta=0.1,
                                  lora_rank=4, lora_alpha=8, lora_target_modules="all-linear", train_iters=4,
                                  checkpoint_factor=2, save=str(tmp_path / "unbroken"),
                                  optimizer={"type": "Adam", "params": {"lr": 0.05}})
    unbroken = run_deepy([write_overrides(tmp_path, name="unbroken.yml", **settings)]).stdout
    assert (f"reference model: {tmp_path / 'hf'} (the model this fine-tune starts from), this run's own frozen base "
            "with its LoRA adapters switched off, no second model in memory") in unbroken
    kl = tensorboard_scalars(tmp_path / "tb")["train/kl"]
    # PEFT's adapters start as a no-op, so the policy is the base at step 1; then they move and the base does not
    assert kl[1] == 0.0 and kl[3] > 0.0, kl
    losses = {int(m[1]): float(m[2]) for m in LINE.finditer(unbroken)}
    records = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]

    saved = tmp_path / "at_step_2"  # the unbroken run's save at step 2, as a copy someone resumes
    saved.mkdir()
    shutil.copytree(tmp_path / "unbroken" / "global_step2", saved / "global_step2")
    (saved / "latest").write_text("global_step2")
    resume = {**settings, "load": str(saved), "finetune": False, "save": str(tmp_path / "resumed"),
              "rollout_log": str(tmp_path / "resumed.jsonl"), "tensorboard_dir": None}
    resumed = run_deepy([write_overrides(tmp_path, name="resume.yml", **resume)]).stdout
    assert {int(m[1]): float(m[2]) for m in LINE.finditer(resumed)} == {i: losses[i] for i in (3, 4)}
    again = [json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    # the same prompts, completions (the sampler's generator), rewards and advantages (the moving average)
    assert again == [r for r in records if r["iteration"] > 2]
    assert any(r["advantage"] != r["reward"] for r in again)  # the baseline the resume restored is not 0


def data_server_settings(tmp_path, port: int, **layout) -> dict:
    return reinforce_settings(tmp_path, reward_function=None, dataset_impl="online", reinforce_leave_one_out=True,
                              kl_impl="abs", online_dataserver_ips="127.0.0.1", online_dataserver_ports=port,
                              train_data_paths=None, train_label_data_paths=None, train_micro_batch_size_per_gpu=3,
                              rollout_log=None, **layout)  # the server's completions are not logged here


@pytest.mark.parametrize("layout", [{}, {"num_gpus": 2, "model_parallel_size": 2}], ids=["1-rank", "tp2"])
def test_gpt_neox_data_server_trains_a_step(tmp_path, layout):
    import pickle

    from tests.unit.test_rollouts import DataServer

    groups = [{"prefix": [2, 3, 10, 5, 4], "completions": [[11, 12, 1], [13, 1], [9]], "rewards": [1.0, 0.0, 0.5]}]
    server = DataServer([pickle.dumps(groups)] * 4)
    settings = data_server_settings(tmp_path, server.port, **layout)
    output = run_deepy([write_overrides(tmp_path, name="server.yml", **settings)]).stdout
    losses = {int(m[1]): float(m[2]) for m in LINE.finditer(output)}
    # one request a refill: at TP 2 only tensor-parallel rank 0 asks, and hands the groups to rank 1
    assert sorted(losses) == [1, 2] and server.requests == ["train", "train"]
    # step 1: policy = reference, so abs's penalty is 0 and kl 0; the mean raw reward of the group is 0.5
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["train/reward"][1] == pytest.approx(0.5) and scalars["train/kl"][1] == 0.0


def test_a_data_server_reply_that_would_run_code_is_refused_on_every_tensor_parallel_rank(tmp_path):
    """At TP 2 rank 0 decodes the reply and hands its one-line refusal to rank 1 (data_server's
    from_tensor_parallel_rank_zero); one rank decodes it with the same decoder and raises it directly."""
    import pickle

    from tests.unit.test_rollouts import DataServer, RunsCode

    marker = tmp_path / "ran"
    bad = DataServer([pickle.dumps([{"prefix": [1], "completions": [[2]], "rewards": [RunsCode(marker)]}])])
    settings = data_server_settings(tmp_path, bad.port, num_gpus=2, model_parallel_size=2, tensorboard_dir=None)
    refused = run_deepy([write_overrides(tmp_path, name="bad.yml", **settings)], expect_success=False)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "nothing of it ran" in said and "Traceback" not in said
    assert not marker.exists()
