"""End to end with tensor parallelism: 2 ranks at model_parallel_size 2 train, save, resume, and move
their weights to size 1 and back through module-only loads, as a user runs them with deepy.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from tests.deepy_runs import REPO_ROOT, checkpoint_files, run_deepy, train_lines, write_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

# Llama family with grouped-query attention, in bf16 under ZeRO-1, 2 ranks forming one tensor-parallel group.
TP_RUN = dict(norm="rmsnorm", activation="swiglu", num_kv_heads=2, rotary_pct=1.0, gpt_j_residual=False,
              use_bias_in_norms=False, use_bias_in_attn_linear=False, use_bias_in_mlp=False,
              rms_norm_epsilon=1.0e-6, intermediate_size=3 * 344, num_layers=2, seq_length=64,
              max_position_embeddings=64, train_micro_batch_size_per_gpu=4, eval_interval=100, eval_iters=1,
              precision="bf16", bf16={"enabled": True}, zero_optimization={"stage": 1},
              checkpoint_validation_with_forward_pass=True)
# A learning rate far below the last bit of any weight: a run that loads weights, takes one step and
# saves them again saves exactly what it loaded.
FROZEN = dict(optimizer={"type": "AdamW", "params": {"lr": 1e-30}}, min_lr=0.0, weight_decay=0.0, train_iters=1,
              checkpoint_factor=1, finetune=True)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """6 iterations at TP 2 saving at 3 and 6; returns (work dir, save dir, training lines)."""
    work = tmp_path_factory.mktemp("tp2")
    save = work / "ckpt"
    overrides = write_overrides(work, save=str(save), train_iters=6, checkpoint_factor=3, num_gpus=2,
                                model_parallel_size=2, **TP_RUN)
    result = run_deepy(["configs/tiny.yml", overrides])
    assert "1 data-parallel rank(s) x 2 tensor-parallel" in result.stdout
    return work, save, train_lines(result.stdout)


@pytest.mark.slow
def test_tp2_zero1_bf16_saves_one_model_file_and_optimizer_shard_per_tensor_parallel_rank(tp2_run):
    _, save, lines = tp2_run
    assert lines[-1].iteration == 6 and lines[-1].loss < lines[0].loss
    files = checkpoint_files(save / "global_step6")
    for mp in (0, 1):
        assert f"mp_rank_{mp:02d}_model_states.pt" in files, files
        assert any(f.endswith(f"zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt") for f in files), files
    halves = [read_module_weights(save / "global_step6", mp) for mp in (0, 1)]
    qkv = "sequential.2.attention.query_key_value.weight"
    assert halves[0][qkv].shape == halves[1][qkv].shape == ((4 + 2 * 2) * 32 // 2, 128)
    assert torch.equal(halves[0]["sequential.2.input_layernorm.scale"], halves[1]["sequential.2.input_layernorm.scale"])

    report = subprocess.run([sys.executable, "tools/ckpts/inspect_checkpoint.py", str(save), "--json"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(report.stdout)["tensor_parallel_size"] == 2


@pytest.mark.slow
def test_tp2_resume_continues_the_loss_curve_exactly(tp2_run):
    work, save, lines = tp2_run
    resumed = write_overrides(work, name="resume.yml", save=str(work / "resumed"), load=str(save), iteration=3,
                              train_iters=6, checkpoint_factor=3, num_gpus=2, model_parallel_size=2, **TP_RUN)
    after = train_lines(run_deepy(["configs/tiny.yml", resumed]).stdout)
    assert [(line.iteration, line.loss) for line in after] == [(line.iteration, line.loss) for line in lines[3:]]


@pytest.mark.slow
def test_a_tp2_zero1_save_resumes_fully_on_one_rank_under_zero3_and_the_loss_goes_on(tp2_run):
    """No conversion step: the plan reshards the optimizer state, and the losses follow the unbroken run's.

    The fp32 master and the moments are the saved ones bit for bit (tests/distributed/test_ckpt_reshard.py); what
    differs is the reduction order (one rank sums each row-parallel product whole, two ranks sum halves
    and all-reduce), and the bf16 activations round such a difference up to one bf16 step (2^-8
    relative) where it crosses a rounding boundary; the loss, an fp32 mean over 256 tokens, stays within
    one bf16 step of the unbroken run's (measured: 6e-5 relative at most).
    """
    work, save, lines = tp2_run
    overrides = write_overrides(work, name="tp1-zero3-resume.yml", load=str(save), save=str(work / "tp1-zero3"),
                                iteration=3, train_iters=6, checkpoint_factor=3, num_gpus=1,
                                **{**TP_RUN, "zero_optimization": {"stage": 3}})
    result = run_deepy(["configs/tiny.yml", overrides])
    assert ("full resume at another shape: optimizer state resharded from DP 1 x TP 2, ZeRO-1 to DP 1 x TP 1, "
            "ZeRO-3") in result.stdout
    after = train_lines(result.stdout)
    assert [line.iteration for line in after] == [line.iteration for line in lines[3:]]
    for resumed, unbroken in zip(after, lines[3:], strict=True):
        assert resumed.loss == pytest.approx(unbroken.loss, rel=2**-8), (resumed, unbroken)


@pytest.mark.slow
def test_module_only_loads_move_the_weights_from_tp2_to_tp1_and_back_without_losing_a_bit(tp2_run):
    """Each load checks the stored logits (checkpoint_validation_with_forward_pass) and the fp32 masters;
    with a vanishing learning rate each run then saves exactly the weights it loaded."""
    work, save, _ = tp2_run
    tp1 = write_overrides(work, name="to-tp1.yml", load=str(save), save=str(work / "tp1"), num_gpus=1,
                          **{**TP_RUN, **FROZEN})
    run_deepy(["configs/tiny.yml", tp1])
    back = write_overrides(work, name="to-tp2.yml", load=str(work / "tp1"), save=str(work / "back"), num_gpus=2,
                           model_parallel_size=2, **{**TP_RUN, **FROZEN})
    run_deepy(["configs/tiny.yml", back])

    whole = read_module_weights(work / "tp1" / "global_step1")
    halves = [read_module_weights(save / "global_step6", mp) for mp in (0, 1)]
    again = [read_module_weights(work / "back" / "global_step1", mp) for mp in (0, 1)]
    qkv = "sequential.2.attention.query_key_value.weight"
    assert whole[qkv].shape[0] == 2 * halves[0][qkv].shape[0]
    for mp in (0, 1):
        assert halves[mp].keys() == again[mp].keys()
        for name, value in halves[mp].items():
            assert torch.equal(again[mp][name], value), (mp, name)


@pytest.mark.slow
def test_a_multi_query_model_moves_from_tp1_to_tp2_with_its_key_value_head_on_both_ranks(tmp_path):
    """One key/value head, two tensor-parallel ranks: the module-only load gives each rank its two query
    heads and the shared head, checks the stored logits and the fp32 masters, and saves them unchanged."""
    mqa = {**TP_RUN, "num_kv_heads": 1}
    first = write_overrides(tmp_path, name="tp1.yml", save=str(tmp_path / "tp1"), train_iters=2, checkpoint_factor=2,
                            num_gpus=1, **mqa)
    run_deepy(["configs/tiny.yml", first])
    split = write_overrides(tmp_path, name="to-tp2.yml", load=str(tmp_path / "tp1"), save=str(tmp_path / "tp2"),
                            num_gpus=2, model_parallel_size=2, **{**mqa, **FROZEN})
    result = run_deepy(["configs/tiny.yml", split])
    assert "1 data-parallel rank(s) x 2 tensor-parallel" in result.stdout

    whole = read_module_weights(tmp_path / "tp1" / "global_step2")
    halves = [read_module_weights(tmp_path / "tp2" / "global_step1", mp) for mp in (0, 1)]
    qkv = "sequential.2.attention.query_key_value.weight"
    head = 32  # hidden 128 over 4 query heads; the full rows are 4 query heads, the key head, the value head
    assert whole[qkv].shape[0] == 6 * head
    for mp, half in enumerate(halves):
        assert half[qkv].shape[0] == 4 * head
        assert torch.equal(half[qkv][:2 * head], whole[qkv][2 * head * mp:2 * head * (mp + 1)]), mp
        assert torch.equal(half[qkv][2 * head:], whole[qkv][4 * head:]), mp
