"""End to end with context parallelism: deepy.py at context_parallel_size 2 trains as one rank does (the same
losses at every step, the same saved weights), as a user runs it."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from tests.deepy_runs import run_deepy, tensorboard_scalars, write_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

# Llama family (rotary over every dimension, so a token at the wrong position changes the loss) in fp32 with
# grouped-query attention, a sliding window shorter than a chunk pair, packed documents apart (positions and the
# mask per document), gradient clipping on (the norm is the whole gradient's only if the context-parallel ranks'
# shares are summed), ZeRO-1 (its partitions are over both context-parallel ranks)
RUN = dict(norm="rmsnorm", activation="swiglu", num_kv_heads=2, rotary_pct=1.0, gpt_j_residual=False,
           use_bias_in_norms=False, use_bias_in_attn_linear=False, use_bias_in_mlp=False, rms_norm_epsilon=1.0e-6,
           num_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=3 * 64, seq_length=64,
           max_position_embeddings=64, train_micro_batch_size_per_gpu=2, train_iters=4, log_interval=1,
           eval_interval=2, eval_iters=1, checkpoint_factor=4, precision="fp32", zero_optimization={"stage": 1},
           gradient_clipping=0.05, lr_decay_iters=4, sliding_window_width=12, reset_position_ids=True,
           reset_attention_mask=True)  # the schedule of 4 steps also for a run of fewer


def run(directory, name: str, **settings):
    save = directory / name
    overrides = write_overrides(directory, name=f"{name}.yml", save=str(save), tensorboard_dir=str(directory / f"tb-{name}"),
                                **{**RUN, **settings})
    result = run_deepy(["configs/tiny.yml", overrides])
    scalars = tensorboard_scalars(directory / f"tb-{name}")
    return result.stdout, scalars["train/loss"], scalars["valid/loss"], save


# Each saves at step 2 as well, which the resumes start from.
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run(tmp_path_factory.mktemp("one"), "one", num_gpus=1, extra_save_iters=[2])


@pytest.fixture(scope="module")
def context_parallel_2(tmp_path_factory):
    return run(tmp_path_factory.mktemp("cp2"), "cp2", num_gpus=2, context_parallel_size=2, extra_save_iters=[2])


def assert_same_steps(one, split, steps: range):
    (_, losses, valid, _), (_, losses_cp, valid_cp, _) = one, split
    assert set(losses_cp) == set(steps), losses_cp
    for step in steps:
        assert losses_cp[step] == pytest.approx(losses[step], rel=1e-5), (step, losses_cp, losses)
    assert set(valid_cp) == {step for step in valid if step in steps}
    for step, loss in valid_cp.items():
        assert loss == pytest.approx(valid[step], rel=1e-5), (step, valid_cp, valid)


def assert_same_weights(save, save_cp, iteration: int, tensor_parallel: int = 1):
    for mp in range(tensor_parallel):
        part, part_cp = (read_module_weights(directory / f"global_step{iteration}", mp) for directory in (save, save_cp))
        assert part.keys() == part_cp.keys()
        for name, value in part.items():
            # atol: Adam divides a gradient near 0 by its own size, so one weight in a tensor may move 2e-6 apart
            assert torch.allclose(part_cp[name], value, rtol=1e-5, atol=1e-5), name


@pytest.mark.slow
def test_context_parallel_2_trains_as_one_rank(one_rank, context_parallel_2):
    stdout = context_parallel_2[0]
    assert "1 data-parallel rank(s) x 1 tensor-parallel x 2 context-parallel" in stdout
    assert "context parallel: each sequence split over 2 ranks" in stdout
    assert_same_steps(one_rank, context_parallel_2, range(1, 5))
    assert_same_weights(one_rank[3], context_parallel_2[3], iteration=4)


@pytest.mark.slow
def test_context_parallel_2_under_zero_3_trains_as_one_rank(tmp_path, one_rank):
    """ZeRO-3 builds the model partitioned over the data x context ranks, as its engine keeps it."""
    split = run(tmp_path, "cp2-zero3", num_gpus=2, context_parallel_size=2, zero_optimization={"stage": 3})
    assert "ZeRO stage 3, 1 data-parallel rank(s) x 1 tensor-parallel x 2 context-parallel" in split[0]
    assert_same_steps(one_rank, split, range(1, 5))


@pytest.mark.slow
@pytest.mark.parametrize("saved_by, resume_at", [("context_parallel_2", 1), ("one_rank", 2)])
def test_a_full_resume_at_another_context_parallel_size_continues_the_unbroken_run(
        request, tmp_path, saved_by, resume_at):
    """The ZeRO-1 partitions of the tag are over data x context-parallel ranks: the load plan reshards them as
    for a data-parallel change; the steps after the resume are the unbroken run's."""
    unbroken = request.getfixturevalue(saved_by)
    resumed = run(tmp_path, "resumed", num_gpus=resume_at, context_parallel_size=resume_at, load=str(unbroken[3]),
                  iteration=2)
    assert "optimizer state resharded from DP" in resumed[0]
    assert_same_steps(unbroken, resumed, range(3, 5))
    assert_same_weights(unbroken[3], resumed[3], iteration=4)


@pytest.mark.slow
def test_tensor_parallel_2_by_context_parallel_2_at_4_ranks_trains_as_one_rank(tmp_path, one_rank):
    """megatron-core's groups in its order tp-cp-dp: ranks 0 and 1 split the layers, 0 and 2 the sequence."""
    split = run(tmp_path, "tp2-cp2", num_gpus=4, model_parallel_size=2, context_parallel_size=2, train_iters=2,
                checkpoint_factor=2)
    assert "1 data-parallel rank(s) x 2 tensor-parallel x 2 context-parallel" in split[0]
    assert_same_steps(one_rank, split, range(1, 3))


@pytest.mark.slow
def test_lora_at_context_parallel_2_trains_as_one_rank(tmp_path):
    """Only the adapters train; their gradients are summed over the context-parallel ranks as any weight's."""
    one = run(tmp_path, "lora-one", num_gpus=1, lora_rank=4)
    split = run(tmp_path, "lora-cp2", num_gpus=2, context_parallel_size=2, lora_rank=4)
    assert "of them train (LoRA adapters" in split[0]
    assert_same_steps(one, split, range(1, 5))


@pytest.mark.slow
def test_dpo_at_context_parallel_2_takes_one_ranks_steps(tmp_path):
    """Each answer's log-probability sums tokens of both context-parallel ranks; the reference model is split too."""
    from tests.e2e.test_dpo import dpo_lines, dpo_run

    settings, _ = dpo_run(tmp_path)
    settings.update(save=None, eval_interval=100)
    one = dpo_lines(run_deepy([write_overrides(tmp_path, name="one.yml", **{**settings, "num_gpus": 1})]).stdout)
    split = dpo_lines(run_deepy([write_overrides(tmp_path, name="cp2.yml", **settings, context_parallel_size=2)]).stdout)
    assert one[1][0] == pytest.approx(0.6931, abs=1e-4)  # ln 2: the policy is the reference at the first step
    assert len({values[0] for values in one.values()}) == 4  # the policy moves away from the reference
    assert split.keys() == one.keys() == {1, 2, 3, 4}
    for step, values in one.items():
        assert split[step] == pytest.approx(values, abs=2e-4), (step, split, one)


@pytest.mark.slow
def test_kto_at_context_parallel_2_takes_one_ranks_steps(tmp_path):
    """KTO's log-ratios sum tokens of both context-parallel ranks, as DPO's do."""
    from tests.e2e.test_dpo import CHOSEN, PROMPTS, REJECTED, chat, save_llama
    from tests.e2e.test_kto import kto_lines
    from tests.e2e.test_preprocess_chat import make_chat_tokenizer, write_jsonl
    from tests.e2e.test_preprocess_chat import run as preprocess

    tokenizer = make_chat_tokenizer(tmp_path / "tok", eos="<|endoftext|>")
    records = [{"messages": chat(prompt, answer), "score": score} for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)
               for prompt, answer, score in ((p, c, 1.0), (p, r, -1.0))]
    preprocess("--input", write_jsonl(tmp_path / "scored.jsonl", records), "--tokenizer-path", str(tokenizer),
               "--jsonl-keys", "messages", "--reward-key", "score", "--output-prefix", str(tmp_path / "kto"))
    save_llama(tmp_path / "hf", seed=0)
    settings = dict(load=str(tmp_path / "hf"), finetune=True, train_impl="kto", kto_beta=0.5, pack_impl="unpacked",
                    **{f"train_{kind}paths": [str(tmp_path / f"kto_messages_{kind.replace('data_', '')}document")]
                       for kind in ("data_", "label_data_", "reward_data_")},
                    tokenizer_type="HFTokenizer", vocab_file=str(tokenizer / "tokenizer.json"), seq_length=24,
                    train_micro_batch_size_per_gpu=4, precision="fp32", zero_optimization={"stage": 1},
                    optimizer={"type": "Adam", "params": {"lr": 0.01}}, train_iters=3, eval_interval=100,
                    num_workers=0)
    one = kto_lines(run_deepy([write_overrides(tmp_path, name="one.yml", **settings, num_gpus=1)]).stdout)
    split = kto_lines(run_deepy([write_overrides(tmp_path, name="cp2.yml", **settings, num_gpus=2,
                                                 context_parallel_size=2)]).stdout)
    assert one[1] == (0.5, 0.0, 0.0) and len({values[0] for values in one.values()}) == 3  # 1 - sigmoid(0), then moves
    assert split.keys() == one.keys() == {1, 2, 3}
    for step, values in one.items():
        assert split[step] == pytest.approx(values, abs=2e-4), (step, split, one)


@pytest.mark.slow
def test_a_reward_model_at_context_parallel_2_takes_one_ranks_steps(tmp_path):
    """Each row's reward is read where its chat ends, on whichever context-parallel rank holds that token: the
    ranks sum their tokens' values into whole rows first."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.e2e.test_preprocess_chat import make_chat_tokenizer, write_jsonl
    from tests.e2e.test_preprocess_chat import run as preprocess
    from tests.e2e.test_reward_model import LLAMA
    from tests.unit.test_data_pairwise import CHOSEN, PROMPTS, REJECTED, chat

    tokenizer = make_chat_tokenizer(tmp_path / "tok", eos="<|endoftext|>")
    records = [{"chosen": chat(p, c), "rejected": chat(p, r)} for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)]
    preprocess("--input", write_jsonl(tmp_path / "pairs.jsonl", records * 2), "--tokenizer-path", str(tokenizer),
               "--jsonl-keys", "chosen", "rejected", "--for-rm", "--output-prefix", str(tmp_path / "rm"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(tmp_path / "hf")
    paths = {f"{sign}_train_{kind}data_paths": [str(tmp_path / f"rm_{key}_{kind}document")]
             for sign, key in (("pos", "chosen"), ("neg", "rejected")) for kind in ("", "label_")}
    settings = dict(load=str(tmp_path / "hf"), finetune=True, tokenizer_type="HFTokenizer",
                    vocab_file=str(tokenizer / "tokenizer.json"), seq_length=24, train_impl="rm",
                    dataset_impl="pairwise", pack_impl="unpacked", allow_chopped=False, no_weight_tying=True,
                    z_loss=0.01, train_micro_batch_size_per_gpu=2, precision="fp32", zero_optimization={"stage": 1},
                    optimizer={"type": "Adam", "params": {"lr": 0.003}}, train_iters=3, eval_interval=100,
                    num_workers=0, log_interval=1, **paths)
    runs = {}
    for name, ranks in (("one", 1), ("cp2", 2)):
        overrides = write_overrides(tmp_path, name=f"{name}.yml", num_gpus=ranks, context_parallel_size=ranks,
                                    tensorboard_dir=str(tmp_path / f"tb-{name}"), **settings)
        run_deepy([overrides])
        runs[name] = tensorboard_scalars(tmp_path / f"tb-{name}")
    one, split = runs["one"], runs["cp2"]
    assert len({round(loss, 6) for loss in one["train/loss"].values()}) == 3  # it moves
    for metric in ("train/loss", "train/accuracy", "train/margin", "train/pos_values"):
        assert split[metric].keys() == one[metric].keys() == {1, 2, 3}, metric
        for step, value in one[metric].items():
            assert split[metric][step] == pytest.approx(value, rel=1e-5, abs=1e-6), (metric, step)
