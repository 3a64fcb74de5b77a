"""GPT-NeoX's reward-model recipe (post-training/configs/llama3-8b-rm.yml) as a GPT-NeoX user starts it: --dry-run."""

from __future__ import annotations

from pathlib import Path

import yaml

import deepy
from megatron.tokenizer import train_bpe_tokenizer
from tests.e2e.test_dry_run import RANK_ECHO, write_data_named_by
from tests.unit.test_neox_args import write_yaml

RECIPE = Path(__file__).resolve().parents[1] / "fixtures" / "gpt_neox" / "post_training" / "llama3-8b-rm.yml"


def test_gpt_neox_rm_recipe_passes_dry_run_at_its_rank_count(tmp_path, capsys, monkeypatch):
    tokenizer = train_bpe_tokenizer(["preference pairs for the recipe's dry run"] * 10, tmp_path / "tokenizer.json",
                                    vocab_size=270)
    # 4 tensor-parallel ranks x 2 data-parallel: one node of 8 GPUs
    overlay = write_yaml(tmp_path, "local.yml", {"num_gpus": 8, "vocab_file": str(tokenizer)})
    monkeypatch.chdir(tmp_path)  # the user's data, where the recipe's relative paths point
    write_data_named_by([RECIPE, overlay], tmp_path)
    assert deepy.main([RANK_ECHO, str(RECIPE), str(overlay), "--dry-run"]) == 0
    report = yaml.safe_load(capsys.readouterr().out)
    settings = report["settings"]
    assert settings["train_impl"] == "rm" and settings["dataset_impl"] == "pairwise"
    assert settings["pack_impl"] == "unpacked" and settings["allow_chopped"] is False
    assert settings["pos_train_label_data_paths"] == ["data/pairwise/llama3_rm_train_chosen_label_document"]
    assert settings["neg_test_data_paths"] == ["data/pairwise/llama3_rm_val_rejected_document"]
    assert settings["z_loss"] == 0.0 and settings["no_weight_tying"] is True
    assert settings["finetune"] is True and settings["model_parallel_size"] == 4
    assert report["deepspeed_config"]["train_batch_size"] == 32 * 2 * 2
