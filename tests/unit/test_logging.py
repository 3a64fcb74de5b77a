"""What a person sees of a run: the training line, and TensorBoard scalars when asked for."""

from __future__ import annotations

import pytest

from megatron.logging import MetricsWriter, ProgressReporter, format_duration, format_train_line
from megatron.neox_arguments import NeoXArgs

SCALARS = {"train/loss": 3.25, "train/lr": 1.5e-4, "train/grad_norm": 0.5, "train/loss_scale": None,
           "train/tokens_per_second": 12345.6, "train/step_seconds": 0.0415}


def test_train_line_names_every_quantity():
    line = format_train_line(7, 300, SCALARS, elapsed=65, left=3725)
    assert line == ("iteration   7/300 | loss 3.2500 | lr 1.500e-04 | grad norm 0.500 | tokens/s 12,346 | "
                    "step 42 ms | elapsed 01:05 | left 1:02:05")


def test_loss_scale_shows_only_when_there_is_one():
    assert "loss scale 65536" in format_train_line(1, 10, {**SCALARS, "train/loss_scale": 65536.0}, 1, 1)
    assert "loss scale" not in format_train_line(1, 10, SCALARS, 1, 1)


def test_skipped_steps_show_when_counted_even_at_zero():
    line = format_train_line(1, 10, {**SCALARS, "train/loss_scale": 256.0, "train/skipped_steps": 3}, 1, 1)
    assert "| loss scale 256 | skipped steps 3 |" in line
    assert "skipped steps 0" in format_train_line(1, 10, {**SCALARS, "train/skipped_steps": 0}, 1, 1)
    assert "skipped" not in format_train_line(1, 10, SCALARS, 1, 1)


@pytest.mark.parametrize("seconds,text", [(0, "00:00"), (59.6, "01:00"), (3600, "1:00:00")])
def test_durations(seconds, text):
    assert format_duration(seconds) == text


def test_tensorboard_receives_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(NeoXArgs.from_dict({"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 4,
                                                "tensorboard_dir": str(tmp_path)}))
    writer.write(SCALARS, step=3)
    writer.write({"valid/loss": 2.5}, step=4)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "train/lr", "train/grad_norm",
                                              "train/tokens_per_second", "train/step_seconds", "valid/loss"}
    (loss,) = events.Scalars("train/loss")
    assert (loss.step, loss.value) == (3, 3.25)
    assert events.Scalars("valid/loss")[0].step == 4


def test_the_line_averages_throughput_over_the_steps_since_the_previous_line(caplog):
    """Steps of 1 s, 3 s, then 0.5 s and 0.5 s: each line shows its own window, not the last step."""
    args = NeoXArgs.from_dict({"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "train_iters": 4,
                               "log_interval": 2, "train_micro_batch_size_per_gpu": 2, "seq_length": 50})
    progress = ProgressReporter(args.train_iters, args.log_interval, args.train_batch_size * args.seq_length,
                                first_iteration=0)
    windows = [progress.step(i + 1, {**SCALARS, "train/step_seconds": seconds})
               for i, seconds in enumerate([1.0, 3.0, 0.5, 0.5])]
    assert windows[0] is None and windows[2] is None
    # 100 tokens a step: 200 tokens in 4 s, then 200 tokens in 1 s
    assert windows[1] == {"train/tokens_per_second": 50.0, "train/step_seconds": 2.0}
    assert windows[3] == {"train/tokens_per_second": 200.0, "train/step_seconds": 0.5}


def test_objective_metrics_follow_the_loss_in_their_order():
    scalars = {**SCALARS, "train/reward_acc": 0.75, "train/chosen_rewards": -0.125}
    line = format_train_line(7, 300, scalars, 65, 3725, metric_names=("chosen_rewards", "reward_acc"))
    assert "| loss 3.2500 | chosen_rewards -0.1250 | reward_acc 0.7500 | lr 1.500e-04 |" in line
