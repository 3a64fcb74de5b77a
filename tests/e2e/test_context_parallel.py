"""End to end with context parallelism: deepy.py at context_parallel_size 2 trains as one rank does (the same
losses at every step, the same saved weights), as a user runs it."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from tests.deepy_runs import run_deepy, tensorboard_scalars, write_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

# Llama family (rotary over every dimension, so a token at the wrong position changes the loss) in fp32 with
# grouped-query attention, gradient clipping on (the norm is the whole gradient's only if the context-parallel
# ranks' shares are summed), ZeRO-1 (its partitions are over both context-parallel ranks)
RUN = dict(norm="rmsnorm", activation="swiglu", num_kv_heads=2, rotary_pct=1.0, gpt_j_residual=False,
           use_bias_in_norms=False, use_bias_in_attn_linear=False, use_bias_in_mlp=False, rms_norm_epsilon=1.0e-6,
           num_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=3 * 64, seq_length=64,
           max_position_embeddings=64, train_micro_batch_size_per_gpu=2, train_iters=4, log_interval=1,
           eval_interval=2, eval_iters=1, checkpoint_factor=4, precision="fp32", zero_optimization={"stage": 1},
           gradient_clipping=0.05)


def run(tmp_path, name: str, **settings):
    save = tmp_path / name
    overrides = write_overrides(tmp_path, name=f"{name}.yml", save=str(save), tensorboard_dir=str(tmp_path / f"tb-{name}"),
                                **{**RUN, **settings})
    result = run_deepy(["configs/tiny.yml", overrides])
    scalars = tensorboard_scalars(tmp_path / f"tb-{name}")
    return result.stdout, scalars["train/loss"], scalars["valid/loss"], save


def assert_same_run(one, split, iteration: int, tensor_parallel: int = 1):
    (_, losses, valid, save), (_, losses_cp, valid_cp, save_cp) = one, split
    assert losses.keys() == losses_cp.keys() and len(losses) == iteration
    for step, loss in losses.items():
        assert losses_cp[step] == pytest.approx(loss, rel=1e-5), (step, losses_cp, losses)
    for step, loss in valid.items():
        assert valid_cp[step] == pytest.approx(loss, rel=1e-5), (step, valid_cp, valid)
    for mp in range(tensor_parallel):
        part, part_cp = (read_module_weights(directory / f"global_step{iteration}", mp) for directory in (save, save_cp))
        assert part.keys() == part_cp.keys()
        for name, value in part.items():
            # atol: Adam divides a gradient near 0 by its own size, so one weight in a tensor may move 2e-6 apart
            assert torch.allclose(part_cp[name], value, rtol=1e-5, atol=1e-5), name


@pytest.mark.slow
def test_context_parallel_2_trains_as_one_rank(tmp_path):
    one = run(tmp_path, "one", num_gpus=1)
    split = run(tmp_path, "cp2", num_gpus=2, context_parallel_size=2)
    stdout = split[0]
    assert "1 data-parallel rank(s) x 1 tensor-parallel x 2 context-parallel" in stdout
    assert "context parallel: each sequence split over 2 ranks" in stdout
    assert_same_run(one, split, iteration=4)
