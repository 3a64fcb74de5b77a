"""End to end with sequence parallelism: deepy.py at model_parallel_size 2 with sequence_parallel trains as the same
run without it (the same losses at every step, the same saved weights), as a user runs it."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from tests.deepy_runs import run_deepy, tensorboard_scalars, write_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

# Llama family in fp32 under ZeRO-1 (the sums of the two layouts differ in order only, so fp32 keeps them within
# 1e-5), hidden dropout on: sequence parallelism draws the same masks
RUN = dict(norm="rmsnorm", activation="swiglu", num_kv_heads=2, rotary_pct=1.0, gpt_j_residual=False,
           use_bias_in_norms=False, use_bias_in_attn_linear=False, use_bias_in_mlp=False, rms_norm_epsilon=1.0e-6,
           num_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=3 * 64, seq_length=64,
           max_position_embeddings=64, hidden_dropout=0.1, train_micro_batch_size_per_gpu=2, train_iters=4,
           log_interval=1, eval_interval=100, eval_iters=1, checkpoint_factor=4, precision="fp32",
           zero_optimization={"stage": 1}, num_gpus=2, model_parallel_size=2)


def run(tmp_path, name: str, **settings):
    save = tmp_path / name
    overrides = write_overrides(tmp_path, name=f"{name}.yml", save=str(save), tensorboard_dir=str(tmp_path / f"tb-{name}"),
                                **{**RUN, **settings})
    result = run_deepy(["configs/tiny.yml", overrides])
    losses = tensorboard_scalars(tmp_path / f"tb-{name}")["train/loss"]
    return result.stdout, losses, save


@pytest.mark.slow
def test_tp2_with_sequence_parallel_trains_as_tp2_without_it(tmp_path):
    _, losses, save = run(tmp_path, "tp2")
    stdout, losses_sp, save_sp = run(tmp_path, "tp2-sp", sequence_parallel=True)
    assert "1 data-parallel rank(s) x 2 tensor-parallel" in stdout
    assert "sequence parallel: the residual stream split over 2 tensor-parallel ranks" in stdout
    assert losses.keys() == losses_sp.keys() == {1, 2, 3, 4}
    for step, loss in losses.items():
        assert losses_sp[step] == pytest.approx(loss, rel=1e-5), (step, losses_sp, losses)
    for mp in (0, 1):
        part, part_sp = (read_module_weights(directory / "global_step4", mp) for directory in (save, save_sp))
        assert part.keys() == part_sp.keys()
        for name, value in part.items():
            assert torch.allclose(part_sp[name], value, rtol=1e-5, atol=1e-6), name


@pytest.mark.slow
def test_pipeline_stages_with_sequence_parallel_train_as_without_it(tmp_path):
    """2 stages x TP 2 on 4 ranks: the parts of the sequence travel between the stages (DeepSpeed's pipe engine
    would send a slice of rank 0's part and one of rank 1's and join them, were its partitioning left on)."""
    stages = dict(num_gpus=4, pipe_parallel_size=2, train_iters=2, checkpoint_factor=2)
    _, losses, _ = run(tmp_path, "pipe", **stages)
    _, losses_sp, _ = run(tmp_path, "pipe-sp", sequence_parallel=True, **stages)
    assert losses.keys() == losses_sp.keys() == {1, 2}
    for step, loss in losses.items():
        assert losses_sp[step] == pytest.approx(loss, rel=1e-5), (step, losses_sp, losses)
