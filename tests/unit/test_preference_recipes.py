"""GPT-NeoX's DPO, KTO and REINFORCE recipes (post-training/configs/llama3-8b-dpo.yml, -kto.yml, -reinforce.yml) as a GPT-NeoX user starts
them: --dry-run at their rank count (4 tensor-parallel ranks x 2 data-parallel: one node of 8 GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import deepy
from megatron.tokenizer import train_bpe_tokenizer
from tests.e2e.test_dry_run import RANK_ECHO, write_data_named_by
from tests.unit.test_neox_args import write_yaml

RECIPES = Path(__file__).resolve().parents[1] / "fixtures" / "gpt_neox" / "post_training"


@pytest.mark.parametrize("recipe, expected", [
    ("llama3-8b-dpo.yml", {"train_impl": "dpo", "dataset_impl": "pairwise", "dpo_beta": 0.01, "dpo_fp32": True,
                           "pos_train_label_data_paths": ["data/pairwise/llama3_dpo_train_chosen_label_document"]}),
    ("llama3-8b-kto.yml", {"train_impl": "kto", "kto_beta": 0.1, "kto_desirable_weight": 1.0,
                           "train_reward_data_paths": ["data/kto/llama3_train_messages_reward_document"]}),
    ("llama3-8b-reinforce.yml", {"train_impl": "reinforce", "dataset_impl": "online", "reinforce_leave_one_out": True,
                                 "kl_impl": "abs", "kl_div_beta": 0.1, "online_dataserver_ports": [10000, 10001]}),
], ids=["dpo", "kto", "reinforce"])
def test_gpt_neox_preference_recipe_passes_dry_run_at_its_rank_count(recipe, expected, tmp_path, capsys, monkeypatch):
    tokenizer = train_bpe_tokenizer(["preference data for the recipe's dry run"] * 10, tmp_path / "tokenizer.json",
                                    vocab_size=270)
    # the reinforce recipe serves its weights to synth-vllm, which is not built here: its users set this instead
    served = {"serve_model_weights": False} if "reinforce" in recipe else {}
    overlay = write_yaml(tmp_path, "local.yml", {"num_gpus": 8, "vocab_file": str(tokenizer), **served})
    monkeypatch.chdir(tmp_path)  # the user's data, where the recipe's relative paths point
    write_data_named_by([RECIPES / recipe, overlay], tmp_path)
    assert deepy.main([RANK_ECHO, str(RECIPES / recipe), str(overlay), "--dry-run"]) == 0
    settings = yaml.safe_load(capsys.readouterr().out)["settings"]
    assert {name: settings[name] for name in expected} == expected
    assert settings["finetune"] is True and settings["model_parallel_size"] == 4


@pytest.mark.parametrize("settings, words", [
    ({"train_impl": "dpo", "train_data_paths": ["x"]}, "dataset_impl: pairwise"),
    ({"train_impl": "dpo", "dataset_impl": "pairwise", "pack_impl": "pack_until_overflow",
      "pos_train_data_paths": ["a"], "neg_train_data_paths": ["b"], "precompute_model_name": "ref"},
     "pack_impl: unpacked"),
    ({"train_impl": "kto", "train_data_paths": ["x"]}, "train_reward_data_paths"),
    ({"train_impl": "kto", "train_data_paths": ["x"], "train_reward_data_paths": ["y"],
      "precompute_model_name": "ref"}, "pack_impl: unpacked"),
    ({"train_impl": "kto", "train_data_paths": ["x"], "train_reward_data_paths": ["y"],
      "train_micro_batch_size_per_gpu": 1}, "2 or more"),
    ({"train_impl": "dpo", "dataset_impl": "pairwise", "pack_impl": "unpacked", "pos_train_data_paths": ["a"],
      "neg_train_data_paths": ["b"], "pos_train_label_data_paths": ["al"], "precompute_model_name": "ref"},
     "needs neg_train_label_data_paths beside neg_train_data_paths"),
    ({"train_impl": "kto", "pack_impl": "unpacked", "train_data_paths": ["x"], "train_reward_data_paths": ["y"],
      "train_label_data_paths": ["xl"], "valid_data_paths": ["v"], "precompute_model_name": "ref"},
     "needs valid_label_data_paths beside valid_data_paths"),
    ({"train_impl": "dpo", "dataset_impl": "pairwise", "pack_impl": "pack_until_overflow",
      "pos_train_data_paths": ["a"], "neg_train_data_paths": ["b"]}, "only with reset_attention_mask: true"),
    ({"train_impl": "rm", "dataset_impl": "pairwise", "pack_impl": "pack_until_overflow", "no_weight_tying": True,
      "reset_attention_mask": True, "pos_train_data_paths": ["a"], "neg_train_data_paths": ["b"],
      "pos_train_label_data_paths": ["al"], "neg_train_label_data_paths": ["bl"]},
     "only with reset_position_ids: true"),
    ({"train_impl": "kto", "pack_impl": "pack_until_overflow", "train_data_paths": ["x"],
      "train_reward_data_paths": ["y"]}, "only with reset_attention_mask: true"),
], ids=["dpo-without-pairs", "precompute-packed", "kto-without-rewards", "kto-precompute-packed", "kto-micro-batch-1",
        "dpo-precompute-without-labels", "kto-precompute-without-labels", "dpo-packed-without-reset",
        "rm-packed-without-position-reset", "kto-packed-without-reset"])
def test_preference_settings_that_cannot_run_are_one_line(settings, words):
    from megatron.neox_arguments import ConfigError
    from tests.unit.test_data_gpt_dataset import make_args

    with pytest.raises(ConfigError) as refused:
        make_args(**settings)
    assert words in str(refused.value) and "\n" not in str(refused.value)
