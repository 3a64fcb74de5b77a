"""A resumed run is bit-identical to one never stopped, its validation and test losses included (CPU fp32,
1 and 2 ranks, dropout on; DeepSpeed's FusedAdam and ZeRO-Offload's DeepSpeedCPUAdam)."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.module_weights import read_module_weights
from tests.e2e import run_deepy, tensorboard_scalars, train_lines, write_overrides

pytestmark = pytest.mark.e2e

TRAIN_ITERS = 12
# lr_decay_iters fixed so both halves follow the same schedule; dropout on so RNG restoring matters;
# an evaluation before the stop and two after it, so the validation position must carry over.
SCHEDULE = dict(lr_decay_iters=TRAIN_ITERS, warmup=3 / TRAIN_ITERS, eval_interval=4, hidden_dropout=0.1,
                keep_last_n_checkpoints=None)


def _train(tmp_path, name, save, train_iters, num_gpus, **settings):
    """The run's training lines and its evaluation losses: {"valid/loss": {step: loss}, "test/loss": ...}."""
    tensorboard = tmp_path / f"{name}-tb"
    overrides = write_overrides(tmp_path, name=f"{name}.yml", save=str(save), train_iters=train_iters,
                                num_gpus=num_gpus, tensorboard_dir=str(tensorboard), **SCHEDULE, **settings)
    lines = train_lines(run_deepy(["configs/tiny.yml", overrides]).stdout)
    scalars = tensorboard_scalars(tensorboard)
    return lines, {tag: scalars.get(tag, {}) for tag in ("valid/loss", "test/loss")}


# ZeRO-Offload: the optimizer step runs in DeepSpeedCPUAdam, not FusedAdam
OFFLOAD = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize("num_gpus, settings", [
    pytest.param(1, {}, id="1"),
    pytest.param(2, {}, id="2", marks=pytest.mark.distributed),
    pytest.param(1, OFFLOAD, id="1-zero_offload"),
])
@pytest.mark.slow
def test_stop_and_resume_gives_the_bits_of_an_unbroken_run(tmp_path, num_gpus, settings):
    unbroken, unbroken_evaluations = _train(tmp_path, "unbroken", tmp_path / "unbroken", TRAIN_ITERS, num_gpus,
                                            **settings)
    halves = tmp_path / "halves"
    _, first_evaluations = _train(tmp_path, "first", halves, TRAIN_ITERS // 2, num_gpus, **settings)
    resumed, resumed_evaluations = _train(tmp_path, "second", halves, TRAIN_ITERS, num_gpus, load=str(halves),
                                          **settings)

    assert resumed[0].iteration == TRAIN_ITERS // 2 + 1
    assert [(line.iteration, line.loss) for line in resumed] == \
        [(line.iteration, line.loss) for line in unbroken if line.iteration > TRAIN_ITERS // 2]
    expected = read_module_weights(tmp_path / "unbroken" / f"global_step{TRAIN_ITERS}")
    actual = read_module_weights(halves / f"global_step{TRAIN_ITERS}")
    differing = {name: int((expected[name] != actual[name]).sum()) for name in expected}
    assert not any(differing.values()), f"elements that differ from the unbroken run: {differing}"
    assert all(torch.equal(expected[name], actual[name]) for name in expected)

    # Validation continues where the first half left it (and the final test reads what the unbroken one read).
    assert sorted(unbroken_evaluations["valid/loss"]) == [4, 8, 12]
    assert first_evaluations["valid/loss"] == {4: unbroken_evaluations["valid/loss"][4]}
    assert resumed_evaluations["valid/loss"] == {step: loss for step, loss in unbroken_evaluations["valid/loss"].items()
                                                 if step > TRAIN_ITERS // 2}
    assert resumed_evaluations["test/loss"] == unbroken_evaluations["test/loss"] != {}
