"""A run that diverges stops at once (bf16/fp32) or after max_nonfinite_steps skipped fp16 steps,
and never saves the non-finite state: real training loops on real DeepSpeed engines."""

from __future__ import annotations

import math
import re

import pytest
import torch

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.launch.run_context import resolve_run_settings
from megatron.neox_arguments import NeoXArgs
from megatron.training.divergence import DivergenceError
from megatron.training.loop import setup, train
from tests.deepy_runs import tensorboard_scalars

pytestmark = pytest.mark.usefixtures("single_rank_world")

# lr 1e4 on this model: loss ~8 at step 1, ~1e9 and ~1e11 at steps 2-3, non-finite at step 4.
DIVERGING_LR = 1.0e4


def run_settings(save, precision="fp32", stage=1, lr=DIVERGING_LR, **overrides) -> NeoXArgs:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, train_iters=8,
                  optimizer={"type": "Adam", "params": {"lr": lr}}, warmup=0, train_micro_batch_size_per_gpu=2,
                  embedded_corpus=True, save=str(save), checkpoint_factor=1, eval_interval=1000, eval_iters=0,
                  log_interval=1, zero_optimization={"stage": stage}, precision=precision)
    if precision in ("fp16", "bf16"):
        values[precision] = {"enabled": True}
    values.update(overrides)
    return resolve_run_settings(NeoXArgs.from_dict(values, require_run_settings=True))  # as deepy.py does


def train_until_stopped(args, before_training=None) -> str:
    engine, state, iterators = setup(args)
    if before_training is not None:
        before_training(engine)
    with pytest.raises(DivergenceError) as stopped:
        train(args, engine, state, iterators)
    return str(stopped.value)


def saved_iterations(save) -> list[int]:
    return sorted(int(p.name.removeprefix("global_step")) for p in save.glob("global_step*"))


def assert_saved_tags_are_finite_and_older_than(save, iteration: int) -> None:
    saved = saved_iterations(save)  # every step from 1 (and 0, the untrained model, where a run saves it)
    assert [tag for tag in saved if tag] == list(range(1, iteration)), f"saved {saved}, diverged at {iteration}"
    assert (save / "latest").read_text().strip() == f"global_step{iteration - 1}"
    for tag in saved:
        weights = read_module_weights(save / f"global_step{tag}")
        assert all(bool(torch.isfinite(w).all()) for w in weights.values()), f"global_step{tag} is not finite"


@pytest.mark.parametrize(("precision", "stage"), [("fp32", 1), ("fp32", 0), ("bf16", 0), ("bf16", 1)])
@pytest.mark.slow
def test_bf16_and_fp32_stop_at_the_first_nonfinite_step_without_saving_it(tmp_path, precision, stage):
    save = tmp_path / "ckpt"
    message = train_until_stopped(run_settings(save, precision, stage))
    seen = re.match(rf"iteration (\d+) \({precision}\): loss ([^,\s]+)(, gradient norm ([^,\s]+))?", message)
    assert seen and {seen[2].rstrip("."), (seen[4] or "").rstrip(".")} & {"nan", "inf"}, message
    diverged = int(seen[1])
    assert "The run diverged: training stops without saving this state" in message and "lr 10000" in message
    assert_saved_tags_are_finite_and_older_than(save, diverged)


def test_nan_gradient_behind_a_finite_loss_is_caught_before_the_save(tmp_path):
    """fp32 ZeRO-0: DeepSpeed reports no gradient norm and applies the step, so only the weights show it."""
    save = tmp_path / "ckpt"
    args = run_settings(save, "fp32", stage=0, lr=1e-3)
    poisoned_step = 3

    def poison(engine):  # one backward per step: the hook's n-th call is step n
        steps = iter(range(1, 100))
        next(engine.module.parameters()).register_hook(
            lambda grad: grad * math.nan if next(steps) == poisoned_step else grad)

    message = train_until_stopped(args, poison)
    assert re.match(rf"iteration {poisoned_step} \(fp32\): parameter \S+ holds NaN or infinity", message), message
    assert_saved_tags_are_finite_and_older_than(save, poisoned_step)


@pytest.mark.usefixtures("fp16_capable_cpu")
def test_fp16_stops_after_more_than_max_nonfinite_steps_skipped_in_a_row(tmp_path):
    save = tmp_path / "ckpt"
    args = run_settings(save, "fp16", train_iters=30, max_nonfinite_steps=3, tensorboard_dir=str(tmp_path / "tb"),
                        fp16={"enabled": True, "initial_scale_power": 8})
    message = train_until_stopped(args)
    first, last = map(int, re.match(r"iterations (\d+)-(\d+) \(fp16\): 4 steps in a row skipped", message).groups())
    assert last - first == 3 and "more than max_nonfinite_steps (3)" in message
    # a skipped step leaves the weights as they were: what was saved up to the stop is finite
    assert_saved_tags_are_finite_and_older_than(save, last)
    skipped = tensorboard_scalars(tmp_path / "tb")["train/skipped_steps"]
    assert skipped[first - 1] == 0 and [skipped[i] for i in range(first, last + 1)] == [1, 2, 3, 4]


@pytest.mark.usefixtures("fp16_capable_cpu")
@pytest.mark.slow
def test_fp16_skips_while_the_loss_scale_settles_are_counted_and_training_goes_on(tmp_path):
    args = run_settings(tmp_path / "ckpt", "fp16", lr=1e-3, train_iters=12, checkpoint_factor=None,
                        tensorboard_dir=str(tmp_path / "tb"), fp16={"enabled": True, "initial_scale_power": 24})
    engine, state, iterators = setup(args)
    result = train(args, engine, state, iterators)
    assert result.iteration == 12
    scalars = tensorboard_scalars(tmp_path / "tb")
    skipped, lr = scalars["train/skipped_steps"], scalars["train/lr"]
    assert 0 < skipped[12] == engine.skipped_steps < 12
    # A skipped step does not advance the LR schedule (as in GPT-NeoX): the next step runs at the same LR;
    # after an applied step the decaying schedule has moved on.
    for step in range(2, 13):
        previous_skipped = skipped[step - 1] > skipped.get(step - 2, 0)
        assert (lr[step] == lr[step - 1]) == previous_skipped, (step, skipped, lr)



def test_a_dpo_run_that_diverges_stops_with_the_same_line_before_any_save(tmp_path):
    """train_impl dpo from a Hugging Face folder, its reference live: the loss is DPO's, the stop is a normal run's."""
    from megatron.launch.run_context import settings_for_run
    from tests.deepy_runs import write_overrides
    from tests.e2e.test_dpo import CHOSEN, PROMPTS, REJECTED, chat, save_llama
    from tests.e2e.test_preprocess_chat import make_chat_tokenizer, run, write_jsonl

    tokenizer = make_chat_tokenizer(tmp_path / "tok", eos="<|endoftext|>")
    records = [{"chosen": chat(p, c), "rejected": chat(p, r)} for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)]
    run("--input", write_jsonl(tmp_path / "pairs.jsonl", records), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "chosen", "rejected", "--output-prefix", str(tmp_path / "dpo"))
    save_llama(tmp_path / "hf", seed=0)
    data = {f"{sign}_train_{kind}paths": [str(tmp_path / f"dpo_{side}_{kind.replace('data_', '')}document")]
            for sign, side in (("pos", "chosen"), ("neg", "rejected")) for kind in ("data_", "label_data_")}
    save = tmp_path / "ckpt"
    config = write_overrides(
        tmp_path, load=str(tmp_path / "hf"), finetune=True, save=str(save), train_impl="dpo", dpo_beta=0.5,
        dataset_impl="pairwise", pack_impl="unpacked", **data, tokenizer_type="HFTokenizer",
        vocab_file=str(tokenizer / "tokenizer.json"), seq_length=24, train_micro_batch_size_per_gpu=2,
        precision="fp32", zero_optimization={"stage": 1}, optimizer={"type": "Adam", "params": {"lr": DIVERGING_LR}},
        warmup=0, train_iters=8, checkpoint_factor=1, eval_interval=1000, eval_iters=0)
    message = train_until_stopped(resolve_run_settings(settings_for_run([str(config)])))
    seen = re.match(r"iteration (\d+) \(fp32\): loss ([^,\s]+)(, gradient norm ([^,\s]+))?", message)
    assert seen and {seen[2].rstrip("."), (seen[4] or "").rstrip(".")} & {"nan", "inf"}, message
    assert "The run diverged: training stops without saving this state" in message and "\n" not in message
    assert_saved_tags_are_finite_and_older_than(save, int(seen[1]))
