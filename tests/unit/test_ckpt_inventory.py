"""Inventory of real checkpoints: DeepSpeed engines at several ZeRO stages, GPT-NeoX pipeline files, HF dirs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk.identity import ReferenceIdentity
from megatron.checkpointing.ondisk.inventory import (
    FORMAT_DEEPSPEED,
    FORMAT_HF,
    FORMAT_INCOMPLETE,
    FORMAT_PIPELINE,
    FORMAT_ZERO3,
    SavedLayout,
    inventory_checkpoint,
)
from megatron.hf import HF_FOLDER
from tests.ckpt_engines import make_args, saved_checkpoint


@pytest.mark.parametrize(
    "stage, precision, optimizer_file, model_file, fmt",
    [
        (0, "fp32", None, "mp_rank_00_model_states.pt", FORMAT_DEEPSPEED),
        (1, "bf16", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt", FORMAT_DEEPSPEED),
        (2, "fp32", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt", FORMAT_DEEPSPEED),
        (3, "bf16", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt",
         FORMAT_ZERO3),
    ],
)
def test_inventory_of_deepspeed_checkpoints(single_rank_world, tmp_path, stage, precision, optimizer_file,
                                            model_file, fmt):
    args = make_args(stage=stage, precision=precision)
    saved_checkpoint(tmp_path, args, iterations=(1, 2))
    inventory = inventory_checkpoint(tmp_path)

    assert inventory.exists and inventory.latest == "global_step2"
    assert list(inventory.tags) == ["global_step1", "global_step2"]
    assert inventory.iterations == [1, 2]
    tag = inventory.tags["global_step2"]
    assert tag.format == fmt == inventory.format
    assert [p.name for p in tag.files if "model_states" in p.name] == [model_file]
    if optimizer_file is None:  # without ZeRO the optimizer state sits in the model-states file
        assert tag.optimizer_files == {}
    else:
        assert {k: p.name for k, p in tag.optimizer_files.items()} == {(0, 0): optimizer_file}
        assert tag.optimizer_dp_ranks == (0,)
    assert tag.has_optimizer_states
    assert tag.mp_ranks == (0,)
    assert tag.saved_layout == SavedLayout(source_format=fmt, tensor_parallel=1, pipeline_stages=1, data_parallel=1,
                                           zero_stage=stage, precision=precision)
    meta = tag.metadata
    assert (meta.zero_stage, meta.precision, meta.dp_world_size) == (stage, precision, 1)
    assert meta.has_module_weights == (stage != 3)  # ZeRO-3 module entries are empty placeholders
    assert meta.client_state.iteration == 2 and meta.client_state.consumed_train_samples == 4
    assert meta.saved_args["hidden_size"] == args.hidden_size


def test_precision_and_stage_come_from_deepspeed_config_without_saved_args(single_rank_world, tmp_path):
    saved_checkpoint(tmp_path, make_args(stage=2, precision="bf16"), client_state={"args": None})
    meta = inventory_checkpoint(tmp_path).tags["global_step1"].metadata  # as if saved by another program
    assert meta.saved_args is None
    assert (meta.zero_stage, meta.precision) == (2, "bf16")


def test_optimizer_files_per_dp_and_mp_rank_and_missing_ones(single_rank_world, tmp_path):
    saved_checkpoint(tmp_path, make_args(stage=1))
    tag_dir = tmp_path / "global_step1"
    optim = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    (tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(optim.read_bytes())
    (tag_dir / "zero_pp_rank_3_mp_rank_00_optim_states.pt").write_bytes(optim.read_bytes())
    tag = inventory_checkpoint(tmp_path).tags["global_step1"]
    assert tag.optimizer_dp_ranks == (0, 1, 3)
    assert tag.saved_layout.data_parallel == 1  # DeepSpeed recorded dp_world_size 1: the copies are strays


def test_pipeline_layer_files(tmp_path):
    tag_dir = tmp_path / "global_step30"
    tag_dir.mkdir(parents=True)
    # GPT-NeoX pipeline checkpoints: client state in mp_rank_00 (module None), weights in layer files
    torch.save({"module": None, "iteration": 30, "args": {"hidden_size": 8}, "dp_world_size": 1,
                "ds_config": {"zero_optimization": {"stage": 1}}}, tag_dir / "mp_rank_00_model_states.pt")
    for layer in (0, 2, 3):
        torch.save({"weight": torch.ones(2)}, tag_dir / f"layer_{layer:02d}-model_00-model_states.pt")
    (tmp_path / "latest").write_text("global_step30")

    tag = inventory_checkpoint(tmp_path).tags["global_step30"]
    assert tag.format == FORMAT_PIPELINE
    assert [p.name for p in tag.layer_files] == [
        "layer_00-model_00-model_states.pt", "layer_02-model_00-model_states.pt", "layer_03-model_00-model_states.pt"]
    assert not tag.metadata.has_module_weights
    assert tag.metadata.client_state.iteration == 30
    assert not tag.has_optimizer_states


def test_tensor_parallel_size_from_mp_rank_files(tmp_path):
    tag_dir = tmp_path / "global_step1"
    tag_dir.mkdir(parents=True)
    for mp in (0, 1):
        torch.save({"module": {"w": torch.ones(1)}}, tag_dir / f"mp_rank_{mp:02d}_model_states.pt")
    tag = inventory_checkpoint(tmp_path).tags["global_step1"]
    assert tag.mp_ranks == (0, 1) and tag.saved_layout.tensor_parallel == 2


def test_hf_model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 8}))
    save_file({"gpt_neox.embed_in.weight": torch.zeros(4, 8)}, str(tmp_path / "model.safetensors"))
    inventory = inventory_checkpoint(tmp_path, HF_FOLDER)
    assert inventory.is_hf and inventory.format == FORMAT_HF
    assert [p.name for p in inventory.hf_files] == ["config.json", "model.safetensors"]
    assert inventory.tags == {}
    assert not inventory_checkpoint(tmp_path).is_hf  # checkpointing reads HF folders only through a source


def test_safetensors_without_config_is_not_hf(tmp_path):
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    inventory = inventory_checkpoint(tmp_path, HF_FOLDER)
    assert not inventory.is_hf and inventory.is_empty


def test_missing_dir_and_incomplete_tag(tmp_path):
    missing = inventory_checkpoint(tmp_path / "nope")
    assert not missing.exists and missing.is_empty
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "latest").write_text("global_step4")
    inventory = inventory_checkpoint(tmp_path)
    assert inventory.tags["global_step4"].format == FORMAT_INCOMPLETE
    assert inventory.tags["global_step4"].metadata is None


def test_latest_naming_a_custom_tag_is_listed(single_rank_world, tmp_path):
    saved_checkpoint(tmp_path, make_args(stage=0))
    (tmp_path / "global_step1").rename(tmp_path / "best")
    (tmp_path / "latest").write_text("best")
    inventory = inventory_checkpoint(tmp_path)
    assert list(inventory.tags) == ["best"]
    assert inventory.tags["best"].iteration is None
    assert inventory.tags["best"].metadata.client_state.iteration == 1


def test_truncated_model_states_file_is_named(single_rank_world, tmp_path):
    saved_checkpoint(tmp_path, make_args(stage=1))
    path = tmp_path / "global_step1" / "mp_rank_00_model_states.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    tag = inventory_checkpoint(tmp_path).tags["global_step1"]
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint file {path}"):
        _ = tag.metadata


def test_one_rule_names_the_tag_a_request_reads(tmp_path):
    """The load plan, the run context, inspect_checkpoint and the HF export all ask chosen_tag."""
    for name in ("global_step2", "global_step5"):
        (tmp_path / name).mkdir()
    (tmp_path / "latest").write_text("global_step5")
    inventory = inventory_checkpoint(tmp_path)
    assert inventory.chosen_tag().tag == "global_step5"
    assert inventory.chosen_tag(iteration=2).tag == "global_step2"
    assert inventory.chosen_tag(tag="global_step2", iteration=5).tag == "global_step2"
    with pytest.raises(CheckpointError, match=r"`iteration: 7` asks for .*global_step7, which does not exist; "
                                              r"available iterations: \[2, 5\]"):
        inventory.chosen_tag(iteration=7)
    with pytest.raises(CheckpointError, match=r"the tag asked for is 'global_step7', but .* does not exist; "
                                              r"available iterations: \[2, 5\]\. Set --tag TAG to pick one\.$"):
        inventory.chosen_tag(tag="global_step7", pick_with="--tag {tag}")
    (tmp_path / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"has no `latest` file naming the tag to load; .*\[2, 5\]"):
        inventory_checkpoint(tmp_path).chosen_tag()


def test_a_partial_folder_is_refused_by_every_reader_of_a_tag_in_the_same_words(tmp_path):
    """A `latest` naming an interrupted save, or such a folder asked for by name, is never read, whoever asks."""
    from megatron.hf.convert import convert_neox_to_hf
    from megatron.launch.run_context import settings_for_run
    from megatron.neox_arguments import ConfigError
    from tools.ckpts.inspect_checkpoint import describe

    run = tmp_path / "run"
    (run / "global_step1").mkdir(parents=True)
    (run / "global_step2.partial").mkdir()
    (run / "latest").write_text("global_step2.partial")
    expected = "names 'global_step2.partial', the folder of an interrupted or unfinished save, which is never loaded"
    config = tmp_path / "run.yml"
    config.write_text(f"load: {run}\n")
    with pytest.raises(ConfigError, match=expected):
        settings_for_run([str(config)])
    for read in (lambda: describe(run, None), lambda: convert_neox_to_hf(run, tmp_path / "hf")):
        with pytest.raises(CheckpointError, match=expected + r"\. Write 'global_step1' \(the newest complete tag\) "
                                                             r"into it, or set --tag global_step1\."):
            read()
    with pytest.raises(CheckpointError, match="the tag asked for is 'global_step2.partial', the folder of an "
                                              "interrupted or unfinished save, which is never loaded. Ask for "
                                              "'global_step1', the newest complete tag."):
        describe(run, "global_step2.partial")
    assert not (tmp_path / "hf").exists()


def test_saved_layout_without_a_recorded_data_parallel_size_counts_up_to_the_highest_shard(tmp_path):
    """GPT-NeoX's and older files may record no dp_world_size: the shards' highest rank says it, a gap included."""
    tag_dir = tmp_path / "global_step1"
    tag_dir.mkdir()
    torch.save({"module": {"w": torch.ones(1)}, "iteration": 1, "args": {"model_parallel_size": 2},
                "ds_config": {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}},
               tag_dir / "mp_rank_00_model_states.pt")
    for dp in (0, 1, 3):
        torch.save({}, tag_dir / f"bf16_zero_pp_rank_{dp}_mp_rank_00_optim_states.pt")
    layout = inventory_checkpoint(tmp_path).tags["global_step1"].saved_layout
    # the settings say 2 tensor-parallel ranks, though only mp_rank_00 is there: read as 2, the missing file named later
    assert layout == SavedLayout(source_format=FORMAT_DEEPSPEED, tensor_parallel=2, pipeline_stages=1,
                                 data_parallel=4, zero_stage=1, precision="bf16")


def gpt_neox_expert_tag(tmp_path, rows_per_rank: dict[int, int], recorded_tp: int | None = 2):
    """A GPT-NeoX-style tag of 8 experts (2 rows each) saved at TP 2 (its settings say so unless `recorded_tp` is
    None), mp rank -> the rows its file holds of the first layer's w1; (the tag folder, the run's architecture)."""
    from tests.unit.test_partitioning import expert_arch

    tag_dir = tmp_path / "global_step1"
    tag_dir.mkdir()
    settings = {"moe_num_experts": 8, **({"model_parallel_size": recorded_tp} if recorded_tp else {})}
    for mp, rows in rows_per_rank.items():
        torch.save({"module": {"sequential.2.mlp.experts.mlp.w1": torch.ones(rows, 8)}, "iteration": 1,
                    "args": settings}, tag_dir / f"mp_rank_{mp:02d}_model_states.pt")
    return tag_dir, expert_arch(8)


def test_the_saved_layout_records_the_experts_and_their_split(tmp_path):
    tag_dir, _ = gpt_neox_expert_tag(tmp_path, {0: 8, 1: 8})
    layout = inventory_checkpoint(tmp_path).tags["global_step1"].saved_layout
    assert (layout.experts, layout.experts_per_rank) == (8, 4)
    assert layout.describe().endswith(", 8 experts (4 per rank)")


@pytest.mark.parametrize(("rows_per_rank", "recorded_tp", "expected"), [
    ({0: 8, 1: 6}, 2, "mp_rank_01_model_states.pt: sequential.2.mlp.experts.mlp.w1 holds 6 rows, the rows of "
                      "experts 4..7 (2 each) expected at tensor-parallel size 2: expert 7 missing. The checkpoint lost"),
    ({0: 8}, 2, "experts 4..7 of every expert layer missing (tensor-parallel rank 1 of 2 held them): no module "
                "weights in "),
    # nothing records the size: the one rank file present reads as a TP 1 tag holding half the experts
    ({0: 8}, None, "mp_rank_00_model_states.pt: sequential.2.mlp.experts.mlp.w1 holds 8 rows, the rows of experts "
                   "0..7 (2 each) expected at tensor-parallel size 1: experts 4..7 missing."),
])
def test_a_checkpoint_that_lost_experts_is_refused_naming_them_and_the_file(tmp_path, rows_per_rank, recorded_tp,
                                                                            expected):
    """A rank file whose expert weight was cut, and a GPT-NeoX tag missing a rank file: read at TP 1, one line
    names the experts and the file, before anything is re-split or loaded."""
    from megatron.checkpointing.ondisk.module_weights import read_this_ranks_module_weights

    tag_dir, arch = gpt_neox_expert_tag(tmp_path, rows_per_rank, recorded_tp)
    saved_tp = inventory_checkpoint(tmp_path).tags["global_step1"].saved_layout.tensor_parallel
    with pytest.raises(CheckpointError) as refused:
        read_this_ranks_module_weights(tag_dir, saved_tp, arch)
    assert expected in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(("record", "problem"), [
    ({"source": "/models/llama", "tag": None}, "has no 'checksum'"),
    ({"source": "/models/llama", "tag": 3, "checksum": "0123456789abcdef"}, "has a 'tag' that is not text"),
    ("/models/llama", "is not a mapping"),
])
def test_a_malformed_lora_base_record_is_refused_in_one_line_naming_the_tag(tmp_path, record, problem):
    tag_dir = tmp_path / "global_step2"
    tag_dir.mkdir()
    torch.save({"module": {}, "iteration": 2, "lora_base": record}, tag_dir / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError) as caught:
        _ = inventory_checkpoint(tmp_path).tags["global_step2"].saved_layout
    message = str(caught.value)
    assert message.startswith(f"{tag_dir}: its record of the base model under its LoRA adapters (client state "
                              f"'lora_base') {problem}, so the adapters cannot be checked")
    assert "iteration: N" in message and "\n" not in message


@pytest.mark.parametrize(("record", "problem"), [
    ({"source": "/runs/sft", "tag": "global_step9"}, "has no 'checksum'"),
    ({"source": ["/runs/sft"], "checksum": "0123456789abcdef"}, "has no 'source'"),
    (["/runs/sft", "global_step9"], "is not a mapping"),
])
def test_a_malformed_reference_model_record_is_refused_in_one_line_naming_the_tag(tmp_path, record, problem):
    """What a DPO/KTO resume reads to find its reference (planning.reference.plan_reference): a damaged record is
    one line, not a KeyError."""
    tag_dir = tmp_path / "global_step2"
    tag_dir.mkdir()
    torch.save({"module": {}, "iteration": 2, "reference_model": record}, tag_dir / "mp_rank_00_model_states.pt")
    client_state = inventory_checkpoint(tmp_path).tags["global_step2"].metadata.client_state
    with pytest.raises(CheckpointError) as caught:
        ReferenceIdentity.from_dict(client_state.reference_model, tag_dir)
    message = str(caught.value)
    assert message.startswith(f"{tag_dir}: its record of the reference model (client state 'reference_model') "
                              f"{problem}, so this run cannot know which model its policy is compared with")
    assert "iteration: N" in message and "\n" not in message
