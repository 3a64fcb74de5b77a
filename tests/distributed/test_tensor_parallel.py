"""Tensor parallelism on 2 CPU ranks over gloo: the same model, loss, gradients and optimizer step as size 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_rank_worker
from tests.worker_report import reported

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")


def run_worker(check: str, work_dir: Path, ranks: int = 2) -> list[dict]:
    records = run_rank_worker(WORKER, check, str(work_dir), ranks=ranks)
    assert reported(records, check=check, ok=True), records
    return records


@pytest.mark.slow
def test_tp2_builds_the_same_model_and_gives_the_same_loss_and_gradients_as_tp1(tmp_path):
    """Both families (and tied embeddings with learned positions, and Qwen3's variants): the full weights drawn
    at TP 2 equal TP 1's bit for bit, and the loss (vocab-parallel cross entropy), logits and gradients agree."""
    records = run_worker("equivalence", tmp_path)
    for family in ("neox", "tied-learned", "llama", "qwen3-yarn"):
        assert reported(records, case=family), records


@pytest.mark.slow
def test_tp2_deepspeed_step_clips_by_the_whole_model_norm_and_matches_tp1(tmp_path):
    """DeepSpeed with the megatron-core mpu: ZeRO 0 and 1 at TP 2 take the same clipped step as TP 1; a Qwen3
    folder fine-tuned at TP 2 through the load plan has transformers' loss and gradients."""
    records = run_worker("deepspeed", tmp_path)
    for family in ("neox", "llama"):
        assert reported(records, case=f"{family} zero1"), records
    assert reported(records, case="qwen3 folder at tp2"), records


@pytest.mark.slow
def test_dpo_and_kto_at_tp2_have_the_loss_and_gradients_of_tp1(tmp_path):
    """The log-probabilities come from each rank's vocabulary slice (GPT-NeoX's KTO applies the vocab-parallel
    cross entropy to gathered logits, whose gradients are wrong at TP > 1)."""
    records = run_worker("preference", tmp_path)
    for name in ("dpo neox", "dpo llama", "kto neox", "kto llama"):
        assert reported(records, case=name), records


@pytest.mark.slow
def test_a_module_only_load_moves_a_checkpoint_from_tp2_to_tp4_on_four_ranks(tmp_path):
    """2 -> 4 on 4 CPU ranks, with 2 key/value heads each shared by two ranks at size 4: the same weights
    bit for bit and the same logits (the load also checks the stored logits and the masters)."""
    records = run_worker("resplit4", tmp_path, ranks=4)
    assert reported(records, case="tp2 -> tp4"), records
