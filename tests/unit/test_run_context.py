"""The model from the checkpoint: a config that names a checkpoint but not the model's shape gets it
from the checkpoint's saved settings or a Hugging Face folder's config.json; a given shape setting
that differs is refused by the load plan."""

from __future__ import annotations

import pytest
import yaml

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.ondisk.inventory import inventory_checkpoint
from megatron.checkpointing.planning.plan import build_load_plan
from megatron.hf import HF_FOLDER
from megatron.launch.run_context import settings_for_run
from megatron.neox_arguments import ConfigError
from tests.ckpt_engines import make_args, saved_checkpoint, tiny_hf_model

RUN = {"finetune": True, "train_iters": 5, "train_micro_batch_size_per_gpu": 2, "lr": 0.001,
       "data_path": "data/text_document", "tokenizer_type": "ByteLevelTokenizer"}


def finetune_yml(tmp_path, **settings):
    path = tmp_path / "finetune.yml"
    path.write_text(yaml.safe_dump({**RUN, **settings}))
    return [str(path)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, single_rank_world):
    root = tmp_path_factory.mktemp("ckpt")
    saved_checkpoint(root, make_args(stage=0, norm="rmsnorm", rotary_emb_base=500000))
    return root


def test_the_model_comes_from_the_checkpoints_saved_settings(checkpoint, tmp_path):
    args = settings_for_run(finetune_yml(tmp_path, load=str(checkpoint)))
    saved = make_args(stage=0, norm="rmsnorm", rotary_emb_base=500000)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "norm", "rotary_emb_base"):
        assert getattr(args, name) == getattr(saved, name), name
        assert args.source_of(name) == f"{checkpoint / 'global_step1'} (saved settings)"
    assert args.source_of("train_iters").endswith("finetune.yml")  # the run's own settings stay the file's
    plan = build_load_plan(args, inventory_checkpoint(checkpoint), 1)
    assert "model settings taken from" in plan.describe() and "num_layers" in plan.describe()


def test_a_given_shape_setting_wins_and_the_plan_refuses_the_difference(checkpoint, tmp_path):
    args = settings_for_run(finetune_yml(tmp_path, load=str(checkpoint), hidden_size=16))
    assert args.hidden_size == 16 and args.num_layers == 2
    with pytest.raises(CheckpointError, match="hidden_size: saved 8, now 16"):
        build_load_plan(args, inventory_checkpoint(checkpoint), 1)


def test_without_load_the_shape_is_required_as_before(tmp_path):
    with pytest.raises(ConfigError, match="num_layers: required"):
        settings_for_run(finetune_yml(tmp_path, finetune=False))


def test_a_checkpoint_without_settings_says_what_to_add(tmp_path):
    root = tmp_path / "ckpt"
    saved_checkpoint(root, make_args(stage=0), client_state={"args": None})
    with pytest.raises(ConfigError, match="records no settings"):
        settings_for_run(finetune_yml(tmp_path, load=str(root)))


def test_the_model_of_a_hugging_face_folder_comes_from_its_config_json(tmp_path):
    hf_dir = tiny_hf_model(tmp_path / "hf")
    args = settings_for_run(finetune_yml(tmp_path, load=str(hf_dir)))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.intermediate_size) == (2, 16, 2, 64)
    assert args.make_vocab_size_divisible_by == 32 and args.source_of("num_layers") == str(hf_dir / "config.json")
    args = settings_for_run(finetune_yml(tmp_path, load=str(hf_dir), num_layers=3))
    args = args.with_values({"padded_vocab_size": 32}, "a tokenizer of at most 32 tokens")
    with pytest.raises(CheckpointError, match="num_layers"):
        build_load_plan(args, inventory_checkpoint(hf_dir, HF_FOLDER), 1)


def test_a_tensor_parallel_checkpoint_gives_its_model_but_not_its_split(tmp_path):
    """A checkpoint saved at model_parallel_size 2 gives a 1-rank run its shape; the run keeps size 1 and
    its module-only load re-splits the weights."""
    from megatron.hf.convert import convert_hf_to_neox

    convert_hf_to_neox(tiny_hf_model(tmp_path / "hf"), tmp_path / "tp2", model_parallel_size=2)
    args = settings_for_run(finetune_yml(tmp_path, load=str(tmp_path / "tp2")))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 16, 2)
    assert args.model_parallel_size == 1 and args.data_parallel_size == 1
    args = args.with_values({"padded_vocab_size": args.padded_vocab_size}, "the checkpoint")
    plan = build_load_plan(args, inventory_checkpoint(tmp_path / "tp2", HF_FOLDER), 1)
    assert "tensor-parallel" in plan.describe()


def test_a_pipelined_checkpoint_gives_its_model_but_not_its_stages(tmp_path, single_rank_world):
    """Saved settings of a 2-stage run (GPT-NeoX's pipe_parallel_size and pipe_partition_method) give a 1-rank
    run the model's shape; the run keeps its own pipeline size (none), whose module-only load takes the layers."""
    root = tmp_path / "pipelined"
    saved = make_args(stage=0)
    saved_checkpoint(root, saved, client_state={"args": {**saved.to_dict(), "pipe_parallel_size": 2, "num_gpus": 2,
                                                         "pipe_partition_method": "uniform"}})
    args = settings_for_run(finetune_yml(tmp_path, load=str(root)))
    assert args.num_layers == saved.num_layers and args.source_of("num_layers") == f"{root / 'global_step1'} (saved settings)"
    assert (args.pipe_parallel_size, args.pipe_partition_method) == (0, "type:transformer|mlp")


def embedded_corpus_yml(tmp_path, **settings):
    """finetune_yml on the embedded corpus, no data_path or tokenizer of its own."""
    path = tmp_path / "finetune.yml"
    run = {name: value for name, value in RUN.items() if name not in ("data_path", "tokenizer_type")}
    path.write_text(yaml.safe_dump({**run, "embedded_corpus": True, **settings}))
    return [str(path)]


@pytest.mark.parametrize("setting", [{"vocab_file": "tokenizer.json"}, {"tokenizer_type": "HFTokenizer"},
                                     {"merge_file": "merges.txt"}])
def test_a_tokenizer_named_beside_the_embedded_corpus_is_refused_not_replaced(tmp_path, setting):
    """The embedded corpus is tokenized with its own tokenizer, which would silently replace the one named."""
    name = next(iter(setting))
    with pytest.raises(ConfigError, match=rf"finetune.yml: {name} is set, but \S*finetune.yml: embedded_corpus trains "
                                          "on the embedded corpus, which brings its own tokenizer; remove"):
        settings_for_run(embedded_corpus_yml(tmp_path, **setting))


def test_the_embedded_corpus_with_a_checkpoints_tokenizer_is_accepted(checkpoint, tmp_path):
    """A fine-tune from a checkpoint takes the tokenizer its run saved: no config file named it."""
    args = settings_for_run(embedded_corpus_yml(tmp_path, load=str(checkpoint)))
    assert args.embedded_corpus and args.source_of("tokenizer_type").endswith("(saved settings)")
