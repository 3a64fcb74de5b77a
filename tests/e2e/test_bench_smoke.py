"""The benchmarks under tools/bench run end to end on a tiny size and print their ratio lines.

No timing or memory assertions (a shared CI machine makes them flaky; speed is measured as ratios
within one process by the benchmarks themselves): only that each script exits 0 and reports every ratio.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "tools" / "bench"
RATIO_LINE = re.compile(r"^RATIO (?P<name>.+?) = (?P<value>\S+)  \(", re.MULTILINE)


def run_bench(script: str, *flags: str) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / script), *flags], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stdout}\n{result.stderr[-3000:]}"
    return {match["name"]: float(match["value"]) for match in RATIO_LINE.finditer(result.stdout)}


def assert_ratios(ratios: dict[str, float], expected: set[str]) -> None:
    assert set(ratios) == expected, f"ratio lines printed: {sorted(ratios)}, expected {sorted(expected)}"
    for name, value in ratios.items():
        assert not math.isnan(value) and value >= 0, f"RATIO {name} = {value}"


@pytest.mark.parametrize("zero_stage", ["1", "3"])
@pytest.mark.slow
def test_module_only_load_bench_prints_its_ratios(zero_stage):
    ratios = run_bench(
        "bench_module_only_load.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
        "--seq", "8", "--repeats", "1", "--precision", "bf16", "--zero-stage", zero_stage,
    )
    expected = {"ours/baseline wall", "ours/baseline cpu", "ours/baseline peak_rss", "ours/baseline node_private",
                "verify/train_step wall", "verify/ours wall", "checksum/ours wall", "checksum/baseline wall"}
    assert_ratios(ratios, expected | ({"ours/raw wall"} if zero_stage != "3" else set()))


@pytest.mark.slow
def test_module_only_load_bench_runs_two_ranks_with_the_files_evicted_before_each_load():
    # --cold and --ranks 2 are independent paths of the bench (the eviction runs on every rank before each load,
    # the spawned world around it): one invocation checks both
    ratios = run_bench(
        "bench_module_only_load.py", "--ranks", "2", "--cold", "--layers", "1", "--hidden", "32", "--heads", "2",
        "--vocab", "64", "--seq", "8", "--repeats", "1", "--precision", "bf16", "--zero-stage", "2",
    )
    assert "ours/baseline node_private" in ratios and "ours/raw wall" in ratios
    assert "read_evicted/read_cached wall" in ratios


@pytest.mark.slow
def test_module_only_load_bench_measures_a_change_of_tensor_parallel_size():
    ratios = run_bench(
        "bench_module_only_load.py", "--ranks", "2", "--tp", "2", "--saved-tp", "1", "--layers", "1", "--hidden", "32",
        "--heads", "2", "--vocab", "64", "--seq", "8", "--repeats", "1", "--precision", "bf16",
    )
    assert "resplit/ours wall" in ratios and "resplit/ours node_private" in ratios


@pytest.mark.slow
def test_zero3_build_bench_prints_its_ratios():
    ratios = run_bench("bench_zero3_build.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
                       "--threads", "1")
    assert_ratios(ratios, {"partitioned build+load/fp32 model", "whole build+load/fp32 model",
                           "partitioned/whole build+load", "save peak/fp32 model", "partitioned/whole build wall"})


@pytest.mark.slow
def test_mmap_read_bench_prints_its_ratios():
    ratios = run_bench("bench_mmap_read.py", "--size-mb", "8")
    assert_ratios(ratios, {
        "mmap/no_mmap rss 1reader", "mmap/no_mmap pss 2readers", "mmap/no_mmap ckpt_pss 2readers",
        "2readers/1reader ckpt_pss mmap", "2readers/1reader ckpt_pss no_mmap",
    })


@pytest.mark.slow
def test_train_step_bench_prints_its_ratios(tmp_path):
    ratios = run_bench(
        "bench_train_step.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
        "--vocab", "64", "--seq", "8", "--batch", "1", "--repeats", "1", "--json", str(tmp_path / "out.json"),
    )
    assert_ratios(ratios, {f"ours/hf tokens_per_s {family} {precision}"
                           for family in ("neox", "llama") for precision in ("fp32", "bf16")})
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert [(r["family"], r["precision"]) for r in results] == [
        ("neox", "fp32"), ("neox", "bf16"), ("llama", "fp32"), ("llama", "bf16")]
    # the transformers model was built with the MLP width ours has, so the two do the same work
    assert all(r["parameters"]["ours"] == r["parameters"]["hf"] for r in results)


@pytest.mark.slow
def test_save_bench_prints_its_ratios():
    ratios = run_bench(
        "bench_save.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "8",
        "--repeats", "1", "--max-steps-in-flight", "2",
    )
    assert_ratios(ratios, {"blocked/synchronous wall", "first_async/synchronous wall", "slowed_steps/synchronous wall",
                           "no_save_optim/synchronous wall", "async peak_rss/tag size", "async kept_rss/tag size"})


@pytest.mark.slow
def test_pipeline_bench_prints_its_ratios():
    ratios = run_bench("bench_pipeline.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
                       "--seq", "8", "--micro-batches", "1", "--repeats", "1", "--steps", "1")
    assert_ratios(ratios, {"two_stages/one_module tokens_per_second", "bubble"})
    assert ratios["bubble"] == pytest.approx(1 / 3, abs=1e-3)  # 2 stages, 2 micro batches


@pytest.mark.slow
def test_reference_zero3_bench_prints_its_ratios():
    ratios = run_bench("bench_reference_zero3.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
                       "--seq", "8", "--rows", "2")
    assert_ratios(ratios, {"zero3/zero1 reference held", "zero3/zero1 reference forward peak",
                           "zero1 reference held/weights", "zero3 reference held/weights"})


@pytest.mark.parametrize("objective", ["dpo", "kto"])
@pytest.mark.slow
def test_preference_step_bench_prints_its_ratios(objective):
    ratios = run_bench("bench_dpo_step.py", "--objective", objective, "--layers", "1", "--hidden", "32", "--heads",
                       "2", "--vocab", "64", "--seq", "8", "--repeats", "1")
    assert_ratios(ratios, {f"{objective}/sft step_seconds", f"{objective}_precomputed/sft step_seconds",
                           f"{objective}/sft peak_rss", f"{objective}_precomputed/{objective} peak_rss"})


@pytest.mark.slow
def test_lora_step_bench_prints_its_ratios():
    ratios = run_bench("bench_lora_step.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
                       "--seq", "8", "--lora-rank", "2", "--steps", "1", "--repeats", "1", "--larger", "2x64")
    assert_ratios(ratios, {"lora/full step_seconds", "lora/full peak_rss", "lora/full peak_rss at 2x64"})


@pytest.mark.slow
def test_moe_step_bench_prints_its_ratios():
    ratios = run_bench("bench_moe_step.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
                       "--seq", "8", "--experts", "4", "--expert-width", "32", "--steps", "1", "--repeats", "1")
    assert_ratios(ratios, {"moe/dense step_seconds", "moe/dense peak_rss", "moe-tp2/moe peak_rss per rank"})


@pytest.mark.parametrize(("script", "flags", "peer"), [
    ("bench_lora_peft.py", ("--lora-rank", "2"), "peft"),
    ("bench_moe_transformers.py", ("--experts", "4", "--expert-width", "32"), "transformers"),
])
@pytest.mark.slow
def test_a_peer_bench_trains_the_same_model_on_both_sides(script, flags, peer, tmp_path):
    """Both sides start from the one Hugging Face folder and take the same batch: in fp32 their first losses agree,
    which says ours built the folder's model and loss as the peer did (not only that the ratios printed)."""
    ratios = run_bench(script, "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "8",
                       "--precision", "fp32", "--steps", "1", "--repeats", "1", *flags, "--json", str(tmp_path / "r.json"))
    assert_ratios(ratios, {f"ours/{peer} step_seconds", f"ours/{peer} peak_rss"})
    first_loss = json.loads((tmp_path / "r.json").read_text())["first_loss"]
    assert first_loss["ours"][0] == pytest.approx(first_loss[peer][0], rel=1e-5), first_loss


LEAVING = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from bench_world import init_world, leaves_the_world

@leaves_the_world
def finishes():
    init_world()
    return "done"

@leaves_the_world
def fails():
    init_world()
    raise RuntimeError("a rank's error")

assert finishes() == "done"
print("after a finished rank:", dist.is_initialized())
try:
    fails()
except RuntimeError:
    print("after a failed rank:", dist.is_initialized())
"""


def test_a_bench_rank_leaves_its_process_group_when_it_finished_and_keeps_it_when_it_failed():
    """A finished rank's gloo group left to the interpreter's teardown can abort the process after its work
    (pytorch#190489); a failed rank's group is kept, its pending work could wait on peers."""
    done = subprocess.run([sys.executable, "-c", LEAVING, str(BENCH_DIR)], capture_output=True, text=True,
                          timeout=120, cwd=BENCH_DIR.parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "after a finished rank: False" in done.stdout, done.stdout
    assert "after a failed rank: True" in done.stdout, done.stdout


@pytest.mark.slow
def test_sequence_parallel_bench_prints_its_ratios():
    ratios = run_bench("bench_sequence_parallel.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab",
                       "64", "--seqs", "16", "--repeats", "1", "--steps", "1")
    assert_ratios(ratios, {"tp2_sp/tp2 peak_rss@16", "tp2_sp/tp2 tokens_per_second@16", "cp2/one peak_rss@16",
                           "cp2/one tokens_per_second@16"})


def test_sft_packing_bench_prints_its_ratio():
    ratios = run_bench("bench_sft_packing.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
                       "--seq", "64", "--records", "16", "--repeats", "1", "--steps", "1")
    assert_ratios(ratios, {"packed/padded trained_tokens_per_second"})


@pytest.mark.slow
def test_rollout_step_bench_prints_its_ratios():
    ratios = run_bench("bench_rollout_step.py", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
                       "--seq", "32", "--prompts", "2", "--completions", "2", "--prompt-tokens", "4",
                       "--new-tokens", "8", "--repeats", "1")
    assert_ratios(ratios, {"rollout/step wall", "kv_cache/recompute tokens_per_s", "ours/transformers tokens_per_s"})
