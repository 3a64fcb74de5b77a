"""What a person sees of a run: the training line, and TensorBoard scalars when asked for."""

from __future__ import annotations

import pytest

from megatron.logging import MetricsWriter, format_duration, format_train_line
from megatron.neox_arguments import NeoXArgs

SCALARS = {"train/loss": 3.25, "train/lr": 1.5e-4, "train/grad_norm": 0.5, "train/loss_scale": None,
           "train/tokens_per_second": 12345.6}


def test_train_line_names_every_quantity():
    line = format_train_line(7, 300, SCALARS, elapsed=65, left=3725)
    assert line == ("iteration   7/300 | loss 3.2500 | lr 1.500e-04 | grad norm 0.500 | tokens/s 12,346 | "
                    "elapsed 01:05 | left 1:02:05")


def test_loss_scale_shows_only_when_there_is_one():
    assert "loss scale 65536" in format_train_line(1, 10, {**SCALARS, "train/loss_scale": 65536.0}, 1, 1)
    assert "loss scale" not in format_train_line(1, 10, SCALARS, 1, 1)


@pytest.mark.parametrize("seconds,text", [(0, "00:00"), (59.6, "01:00"), (3600, "1:00:00")])
def test_durations(seconds, text):
    assert format_duration(seconds) == text


def test_tensorboard_receives_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(NeoXArgs({"tensorboard_dir": str(tmp_path)}))
    writer.write(SCALARS, step=3)
    writer.write({"valid/loss": 2.5}, step=4)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "train/lr", "train/grad_norm",
                                              "train/tokens_per_second", "valid/loss"}
    (loss,) = events.Scalars("train/loss")
    assert (loss.step, loss.value) == (3, 3.25)
    assert events.Scalars("valid/loss")[0].step == 4
