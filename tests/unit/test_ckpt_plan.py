"""The load plan: the table of megatron/checkpointing/planning/plan.py row by row, tag selection, and every refusal with its message."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from megatron.checkpointing import plan_load
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk.client_state import (
    FORMAT_VERSION,
    FORMAT_VERSION_KEY,
    RNG_STATES_KEY,
    ClientState,
)
from megatron.checkpointing.ondisk.inventory import inventory_checkpoint, inventory_tag
from megatron.checkpointing.ondisk.rng import collect_rng_states
from megatron.checkpointing.planning.data_position import DataPosition
from megatron.checkpointing.planning.plan import LoadMode, build_load_plan
from megatron.hf import HF_FOLDER
from tests.ckpt_engines import hf_settings, make_args, saved_checkpoint, tiny_hf_model


def with_rng(world_size=1):
    return {RNG_STATES_KEY: [collect_rng_states() for _ in range(world_size)]}


@pytest.fixture(scope="module")
def checkpoints(single_rank_world, tmp_path_factory):
    """Real checkpoints saved by DeepSpeed: ZeRO-1 fp32 (tags 1, 2), ZeRO-0 bf16, ZeRO-3 fp32."""
    base = tmp_path_factory.mktemp("ckpts")
    return {
        "zero1": saved_checkpoint(base / "zero1", make_args(stage=1), iterations=(1, 2), client_state=with_rng()),
        "zero0": saved_checkpoint(base / "zero0", make_args(stage=0, precision="bf16"), client_state=with_rng()),
        "zero3": saved_checkpoint(base / "zero3", make_args(stage=3), client_state=with_rng()),
    }


@pytest.fixture
def zero1_copy(checkpoints, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(checkpoints["zero1"], target)
    return target


def plan_for(load, dp=1, **settings):
    stage = settings.pop("stage", 1)
    precision = settings.pop("precision", "fp32")
    args = make_args(stage=stage, precision=precision, load=str(load), **settings)
    return build_load_plan(args, inventory_checkpoint(load, HF_FOLDER), dp)


# --- the table, row by row ---------------------------------------------------------------

def test_resume_loads_everything_from_latest(checkpoints):
    root = checkpoints["zero1"]
    plan = plan_for(root)
    assert plan.mode is LoadMode.RESUME
    assert (plan.tag, plan.tag_dir, plan.saved_iteration) == ("global_step2", root / "global_step2", 2)
    assert plan.load_optimizer and plan.iteration_from_checkpoint and plan.restore_rng
    assert sorted(p.name for p in plan.files) == ["mp_rank_00_model_states.pt",
                                                 "zero_pp_rank_0_mp_rank_00_optim_states.pt"]


def test_no_load_optim_keeps_iteration_and_rng_but_never_reads_optimizer_files(checkpoints):
    plan = plan_for(checkpoints["zero1"], no_load_optim=True)
    assert plan.mode is LoadMode.NO_LOAD_OPTIM
    assert not plan.load_optimizer and plan.module_only
    assert plan.iteration_from_checkpoint and plan.restore_rng and plan.saved_iteration == 2
    assert [p.name for p in plan.files] == ["mp_rank_00_model_states.pt"]


def test_no_load_optim_with_no_load_rng_leaves_rng_fresh(checkpoints):
    plan = plan_for(checkpoints["zero1"], no_load_optim=True, no_load_rng=True)
    assert plan.iteration_from_checkpoint and not plan.restore_rng
    assert "no_load_rng" in plan.describe()


def test_finetune_starts_at_zero_without_rng(checkpoints):
    plan = plan_for(checkpoints["zero1"], finetune=True)
    assert plan.mode is LoadMode.FINETUNE
    assert not plan.load_optimizer and not plan.iteration_from_checkpoint and not plan.restore_rng
    text = plan.describe()
    assert "iteration 0" in text and "RNG states" in text.split("fresh:")[1]


def test_finetune_wins_over_no_load_optim(checkpoints):
    assert plan_for(checkpoints["zero1"], finetune=True, no_load_optim=True).mode is LoadMode.FINETUNE


def test_describe_names_mode_tag_and_files(checkpoints):
    root = checkpoints["zero1"]
    text = plan_for(root).describe()
    assert f"resume from {root / 'global_step2'}" in text
    assert "optimizer states" in text.split("loaded:")[1].split("\n")[0]
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in text
    fresh_line = plan_for(root, no_load_optim=True).describe().split("fresh:")[1].split("\n")[0]
    assert "optimizer states" in fresh_line


def test_rng_not_restored_when_saved_by_another_world_size(single_rank_world, tmp_path):
    root = tmp_path / "ckpt"
    saved_checkpoint(root, make_args(stage=0), client_state=with_rng(world_size=4))
    plan = plan_for(root, stage=0)
    assert not plan.restore_rng
    assert "saved by 4 ranks" in plan.describe()


def test_zero_stage_0_resume_with_another_dp_size_is_fine(checkpoints):
    plan = plan_for(checkpoints["zero0"], dp=4, stage=0, precision="bf16")
    assert plan.load_optimizer  # the whole optimizer state sits in the model-states file


def test_zero3_resume_reads_deepspeeds_files_and_the_full_module_file_the_name_check_reads(checkpoints, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoints["zero3"], root)
    full_module = root / "global_step1" / "mp_rank_00_model_states.pt"  # what save_engine_checkpoint adds
    shutil.copy(root / "global_step1" / "zero_pp_rank_0_mp_rank_00_model_states.pt", full_module)
    plan = plan_for(root, stage=3)
    assert plan.load_optimizer
    assert sorted(p.name for p in plan.files) == ["mp_rank_00_model_states.pt",
                                                 "zero_pp_rank_0_mp_rank_00_model_states.pt",
                                                 "zero_pp_rank_0_mp_rank_00_optim_states.pt"]


def test_universal_checkpoint_may_change_dp_size_when_enabled(zero1_copy):
    (zero1_copy / "global_step2" / "zero").mkdir()  # what ds_to_universal writes
    plan = plan_for(zero1_copy, dp=2, deepspeed_extra_args={"checkpoint": {"load_universal": True}})
    assert plan.load_optimizer and plan.shape_change is None  # DeepSpeed's own universal load, as the user asked


def test_resume_at_another_shape_is_planned_as_a_reshard(checkpoints, tmp_path):
    plan = plan_for(checkpoints["zero1"], dp=2, stage=3, precision="bf16", save=str(tmp_path))
    assert plan.load_optimizer
    assert ("full resume at another shape: optimizer state resharded from DP 1 x TP 1, ZeRO-1 to DP 2 x TP 1, "
            "ZeRO-3, fp32 to bf16") in plan.describe()
    assert plan.files == tuple(sorted((checkpoints["zero1"] / "global_step2").glob("*_states.pt")))
    assert plan_for(checkpoints["zero1"], save=str(tmp_path)).shape_change is None  # the same shape: DeepSpeed's load


def test_resume_at_another_shape_writes_nothing_so_needs_no_save_directory(checkpoints):
    assert plan_for(checkpoints["zero1"], dp=2).shape_change is not None


def test_resume_at_another_shape_into_a_run_without_zero_is_refused(checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match=r"without ZeRO do not offer.*stage to 1, 2 or 3.*no_load_optim: true"):
        plan_for(checkpoints["zero1"], dp=2, stage=0, save=str(tmp_path))


def test_zero0_optimizer_in_the_model_file_resumes_only_at_its_shape(checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match=r"ZeRO stage 0 in bf16.*cannot read.*no_load_optim: true"):
        plan_for(checkpoints["zero0"], stage=1, precision="bf16", save=str(tmp_path))


def test_zero3_module_only_reads_shards_when_no_full_module_file(checkpoints):
    plan = plan_for(checkpoints["zero3"], stage=3, finetune=True)
    assert plan.source_format == "zero3"
    assert sorted(p.name for p in plan.files) == ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                                 "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert "ZeRO-3" in plan.describe()


# --- tag selection ---------------------------------------------------------------------

def test_iteration_picks_its_tag_over_latest(checkpoints):
    plan = plan_for(checkpoints["zero1"], iteration=1)
    assert plan.tag == "global_step1" and plan.saved_iteration == 1


def test_missing_iteration_lists_available_ones(checkpoints):
    root = checkpoints["zero1"]
    with pytest.raises(CheckpointError) as error:
        plan_for(root, iteration=7)
    message = str(error.value)
    assert str(root / "global_step7") in message and "available iterations: [1, 2]" in message


def test_latest_naming_a_missing_tag(zero1_copy):
    (zero1_copy / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match=r"names tag 'global_step9'.*available iterations: \[1, 2\]"):
        plan_for(zero1_copy)


def test_no_latest_file_asks_for_iteration(zero1_copy):
    (zero1_copy / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"no `latest` file.*\[1, 2\].*iteration: N"):
        plan_for(zero1_copy)
    assert plan_for(zero1_copy, iteration=1).tag == "global_step1"


def test_incomplete_tag_is_refused(zero1_copy):
    for path in (zero1_copy / "global_step2").iterdir():
        path.unlink()
    with pytest.raises(CheckpointError, match=f"{zero1_copy / 'global_step2'} is incomplete"):
        plan_for(zero1_copy)


@pytest.mark.parametrize("settings", [{}, {"no_load_optim": True}], ids=["resume", "no_load_optim"])
def test_train_iters_at_or_below_the_loaded_iteration_is_refused(checkpoints, settings):
    root = checkpoints["zero1"]  # latest: iteration 2
    for train_iters in (1, 2):
        with pytest.raises(CheckpointError, match=rf"train_iters is {train_iters}, but {root / 'global_step2'} "
                                                  r"was saved at iteration 2, so there is nothing left to train"):
            plan_for(root, train_iters=train_iters, **settings)
    assert plan_for(root, train_iters=3, **settings).saved_iteration == 2


def test_finetune_restarts_at_zero_so_any_train_iters_will_do(checkpoints):
    assert plan_for(checkpoints["zero1"], train_iters=1, finetune=True).mode is LoadMode.FINETUNE


# --- nothing there ----------------------------------------------------------------------

def test_missing_load_dir_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nope'} does not exist"):
        plan_for(tmp_path / "nope")


def test_empty_load_dir_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path} holds no checkpoint"):
        plan_for(tmp_path, save=str(tmp_path / "elsewhere"))


@pytest.fixture
def neox_log():
    from megatron.logging import get_logger

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = get_logger()
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_auto_resume_first_run_proceeds_with_one_log_line(tmp_path, neox_log):
    run_dir = tmp_path / "run"  # may not exist yet either
    args = make_args(load=str(run_dir), save=str(run_dir))
    plan = plan_load(args, 1)
    assert plan.mode is LoadMode.FIRST_RUN and plan.nothing_to_load
    messages = [r.getMessage() for r in neox_log]
    assert len(messages) == 1 and "first run" in messages[0] and str(run_dir) in messages[0]
    assert "\n" not in messages[0]


def test_auto_resume_does_not_excuse_finetune_or_an_iteration(tmp_path):
    for settings in ({"finetune": True}, {"iteration": 3}):
        with pytest.raises(CheckpointError):
            plan_load(make_args(load=str(tmp_path), save=str(tmp_path), **settings), 1)


def test_plan_load_without_load_is_none():
    assert plan_load(make_args(), 1) is None


# --- what cannot be carried out --------------------------------------------------------

def test_resume_without_optimizer_states_says_which_setting(zero1_copy):
    for tag in ("global_step1", "global_step2"):
        (zero1_copy / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError) as error:
        plan_for(zero1_copy)
    message = str(error.value)
    assert "holds none" in message and "no_load_optim: true" in message and "finetune: true" in message
    assert plan_for(zero1_copy, no_load_optim=True).module_only  # the weights are still usable


def test_missing_optimizer_shard_is_named(zero1_copy):
    tag_dir = zero1_copy / "global_step2"
    (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        plan_for(zero1_copy, dp=2, save=str(zero1_copy.parent / "save"))


def test_truncated_optimizer_file_is_named_before_any_engine(zero1_copy):
    path = zero1_copy / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{path} is truncated"):
        plan_for(zero1_copy)
    assert plan_for(zero1_copy, finetune=True).module_only  # a module-only load never reads it


def test_full_resume_at_another_tensor_parallel_size_is_planned_as_a_reshard(checkpoints, tmp_path):
    plan = plan_for(checkpoints["zero1"], model_parallel_size=2, num_gpus=2, save=str(tmp_path))
    assert "resharded from DP 1 x TP 1, ZeRO-1 to DP 1 x TP 2, ZeRO-1" in plan.describe()


@pytest.mark.parametrize("mode", [{"finetune": True}, {"no_load_optim": True}])
def test_module_only_load_at_another_tensor_parallel_size_re_splits_every_mp_file(checkpoints, mode):
    plan = plan_for(checkpoints["zero1"], model_parallel_size=2, num_gpus=2, **mode)
    assert "re-split from tensor-parallel size 1 to 2" in plan.describe()
    assert [p.name for p in plan.files] == ["mp_rank_00_model_states.pt"]


def test_a_size_change_that_pads_the_vocabulary_otherwise_names_the_setting_to_change(checkpoints):
    saved = inventory_checkpoint(checkpoints["zero1"]).tags["global_step2"].metadata.saved_args
    with pytest.raises(CheckpointError, match=r"pads the vocabulary to .* rows.*make_vocab_size_divisible_by"):
        plan_for(checkpoints["zero1"], model_parallel_size=2, num_gpus=2, finetune=True,
                 padded_vocab_size=saved["padded_vocab_size"] + 2)


def test_architecture_mismatch_names_settings_and_values(checkpoints):
    with pytest.raises(CheckpointError) as error:
        plan_for(checkpoints["zero1"], finetune=True, hidden_size=16, norm="rmsnorm")
    message = str(error.value)
    assert "hidden_size: saved 8, now 16" in message and "norm: saved 'layernorm', now 'rmsnorm'" in message
    assert str(checkpoints["zero1"] / "global_step2") in message


def test_kv_heads_unset_equals_one_per_query_head(checkpoints):
    plan = plan_for(checkpoints["zero1"], num_kv_heads=2)  # saved with num_kv_heads unset and 2 heads
    assert plan.load_optimizer
    with pytest.raises(CheckpointError, match="num_kv_heads: saved 2, now 1"):
        plan_for(checkpoints["zero1"], num_kv_heads=1)


def test_architecture_check_follows_load_module_strict(checkpoints):
    plan = plan_for(checkpoints["zero1"], finetune=True, num_layers=3, load_module_strict=False)
    assert plan.module_only


def test_iteration_falls_back_to_deepspeeds_step_count(single_rank_world, tmp_path):
    root = tmp_path / "ckpt"
    saved_checkpoint(root, make_args(stage=0), iterations=(2,), client_state={"iteration": None})
    (root / "global_step2").rename(root / "best")
    (root / "latest").write_text("best")
    assert plan_for(root, stage=0, no_load_optim=True).saved_iteration == 2  # DeepSpeed's global_steps


def test_unknown_iteration_only_finetunes(tmp_path):
    (tmp_path / "best").mkdir()
    torch.save({"module": {"w": torch.ones(2)}}, tmp_path / "best" / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("best")
    with pytest.raises(CheckpointError, match="records no iteration.*finetune: true"):
        plan_for(tmp_path, stage=0, no_load_optim=True)
    assert plan_for(tmp_path, stage=0, finetune=True).tag == "best"


def test_newer_checkpoint_format_is_refused(single_rank_world, tmp_path):
    saved_checkpoint(tmp_path, make_args(stage=0), client_state={FORMAT_VERSION_KEY: FORMAT_VERSION + 1})
    with pytest.raises(CheckpointError, match=f"mp_rank_00_model_states.pt was written in checkpoint format {FORMAT_VERSION + 1}"):
        plan_for(tmp_path, stage=0, finetune=True)


def test_pipeline_checkpoint_loads_module_only(tmp_path):
    tag_dir = tmp_path / "global_step30"
    tag_dir.mkdir(parents=True)
    torch.save({"module": None, "iteration": 30, "args": {"num_layers": 2},
                "ds_config": {"zero_optimization": {"stage": 1}}}, tag_dir / "mp_rank_00_model_states.pt")
    torch.save({"w": torch.ones(2)}, tag_dir / "layer_00-model_00-model_states.pt")
    torch.save({"zero": "shard"}, tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "latest").write_text("global_step30")
    with pytest.raises(CheckpointError, match=r"is a pipeline checkpoint of 1 stage\(s\) \(layer files\), this run has "
                       r"pipe_parallel_size 0; .* To load its weights, set `no_load_optim: true`"):
        plan_for(tmp_path)
    plan = plan_for(tmp_path, no_load_optim=True)
    assert plan.saved_iteration == 30 and plan.source_format == "pipeline"
    assert [p.name for p in plan.files] == ["mp_rank_00_model_states.pt", "layer_00-model_00-model_states.pt"]
    assert "RNG states not restored" in plan.describe()  # none saved


def test_a_pipelined_save_resumes_only_at_its_number_of_stages(tmp_path):
    """What DeepSpeed's pipe engine writes for 2 stages at tensor-parallel size 1: one mp_rank file and one ZeRO-1
    shard per stage, layer files of tensor-parallel rank 0; the saved settings record the stages."""
    tag_dir = tmp_path / "global_step4"
    tag_dir.mkdir(parents=True)
    for stage in (0, 1):
        torch.save({"module": None, "iteration": 4, "dp_world_size": 1,
                    "args": {"num_layers": 2, "pipe_parallel_size": 2, "model_parallel_size": 1},
                    "ds_config": {"zero_optimization": {"stage": 1}}}, tag_dir / f"mp_rank_{stage:02d}_model_states.pt")
        torch.save({"zero": "shard"}, tag_dir / f"zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt")
    for layer in (0, 2, 3, 5, 6):
        torch.save({"w": torch.ones(2)}, tag_dir / f"layer_{layer:02d}-model_00-model_states.pt")
    (tmp_path / "latest").write_text("global_step4")
    tag = inventory_tag(tmp_path, "global_step4")
    assert (tag.saved_layout.tensor_parallel, tag.saved_layout.pipeline_stages, tag.engine_mp_ranks) == (1, 2, (0, 1))
    with pytest.raises(CheckpointError, match=r"is a pipeline checkpoint of 2 stage\(s\) \(layer files\), this run "
                       r"has pipe_parallel_size 0; .* Set `pipe_parallel_size: 2` to resume, or set `no_load_optim"):
        plan_for(tmp_path)
    plan = plan_for(tmp_path, pipe_parallel_size=2, num_gpus=2)
    assert plan.load_optimizer and plan.source_format == "pipeline"
    assert {"layer_00-model_00-model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"} <= {
        p.name for p in plan.files}
    assert plan_for(tmp_path, no_load_optim=True).files[-1].name == "layer_06-model_00-model_states.pt"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf"))


def test_hf_dir_finetunes(hf_dir):
    plan = plan_for(hf_dir, finetune=True, **hf_settings(hf_dir))
    assert plan.source_format == "hf" and plan.module_only and not plan.iteration_from_checkpoint
    assert [p.name for p in plan.files] == ["config.json", "model.safetensors"]
    assert not plan.restore_rng and plan.client_state == ClientState(format_version=None)
    assert "its files are not checksummed" in plan.describe()  # what is not checked is said


def test_hf_dir_with_other_architecture_fails_before_any_engine(hf_dir):
    with pytest.raises(CheckpointError, match=f"(?s){hf_dir}.*num_layers"):
        plan_for(hf_dir, finetune=True, **dict(hf_settings(hf_dir), num_layers=3))


@pytest.mark.parametrize("settings", [{}, {"no_load_optim": True}, {"finetune": True, "iteration": 5}])
def test_hf_dir_refuses_what_it_cannot_hold(hf_dir, settings):
    with pytest.raises(CheckpointError, match=f"{hf_dir}.*Hugging Face.*finetune: true"):
        plan_for(hf_dir, **settings, **hf_settings(hf_dir))


def test_checkpoint_converted_from_hf_loads_module_only(hf_dir, tmp_path):
    from megatron.hf.convert import convert_hf_to_neox

    convert_hf_to_neox(hf_dir, tmp_path / "converted")
    settings = hf_settings(hf_dir)
    with pytest.raises(CheckpointError, match="holds none.*no_load_optim: true"):
        plan_for(tmp_path / "converted", **settings)
    plan = plan_for(tmp_path / "converted", finetune=True, **settings)
    assert [p.name for p in plan.files] == ["mp_rank_00_model_states.pt"]


def test_a_converted_tag_is_committed_as_a_save_is_so_damage_to_it_is_named(hf_dir, tmp_path):
    from megatron.hf.convert import convert_hf_to_neox

    tag_dir = convert_hf_to_neox(hf_dir, tmp_path / "converted").tag_dir
    recorded = json.loads((tag_dir / "manifest.json").read_text())
    assert "mp_rank_00_model_states.pt" in json.dumps(recorded)
    module_file = tag_dir / "mp_rank_00_model_states.pt"
    with module_file.open("r+b") as f:  # one byte flipped inside the file, its size unchanged
        f.seek(module_file.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt is damaged"):
        plan_for(tmp_path / "converted", finetune=True, **hf_settings(hf_dir))


# --- the data position, and settings changed since the save that move it ------------------

def _saved(root, iterations=(2,), **client_state):
    saved_checkpoint(root, make_args(stage=0), iterations=iterations, client_state=client_state)
    return root


def test_resume_continues_train_and_validation_where_the_checkpoint_recorded_them(single_rank_world, tmp_path):
    root = _saved(tmp_path / "ckpt", consumed_valid_samples=12)
    for mode in ({}, {"no_load_optim": True}):
        plan = plan_for(root, stage=0, **mode)
        assert plan.data_position == DataPosition(consumed_train_samples=4, consumed_valid_samples=12)
        assert "data position (after iteration 2: train sample 4, validation sample 12)" in plan.describe()
        assert "recorded" not in plan.describe()
    assert plan_for(root, stage=0, finetune=True).data_position is None


def test_positions_a_checkpoint_lacks_are_derived_as_gpt_neox_does_and_said(single_rank_world, tmp_path):
    # GPT-NeoX records neither count; ours recorded no validation position before it was added.
    root = _saved(tmp_path / "ckpt", iterations=(5,), consumed_train_samples=None)
    plan = plan_for(root, stage=0, eval_interval=2, eval_iters=3, train_iters=10)
    # 5 // 2 = 2 evaluations of eval_iters 3 x 2 samples (micro batch 2 on 1 rank); 5 steps of 2 samples
    assert plan.data_position == DataPosition(10, 12, plan.data_position.notes)
    text = plan.describe()
    assert "no consumed_train_samples recorded: training continues at sample iteration 5 x train_batch_size 2 = 10" \
        in text
    assert ("no consumed_valid_samples recorded: validation continues at sample 12, derived as GPT-NeoX does "
            "(2 evaluations up to iteration 5 at eval_interval 2, 6 samples each)") in text


@pytest.mark.parametrize("mode", [{}, {"no_load_optim": True}])
def test_resume_with_another_seq_length_is_refused_with_the_way_out(checkpoints, mode):
    with pytest.raises(CheckpointError) as refusal:
        plan_for(checkpoints["zero1"], seq_length=8, **mode)
    message = str(refusal.value)
    assert "seq_length is 8, but global_step2 was trained on samples of 4 tokens" in message
    assert "Set seq_length back to 4, or set `finetune: true`" in message and "\n" not in message
    assert plan_for(checkpoints["zero1"], seq_length=8, finetune=True).mode is LoadMode.FINETUNE


def test_another_micro_batch_with_the_same_global_batch_keeps_every_step_s_samples(checkpoints):
    # saved: micro batch 2, no accumulation, 1 rank
    plan = plan_for(checkpoints["zero1"], train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2,
                    train_batch_size=2)
    assert ("train_micro_batch_size_per_gpu 2 -> 1 with train_batch_size 2 unchanged: every step trains on the "
            "samples it would have, in other micro batches") in plan.describe()


def test_another_global_batch_says_where_steps_continue(checkpoints):
    plan = plan_for(checkpoints["zero1"], gradient_accumulation_steps=2, train_batch_size=4)
    assert ("train_batch_size 2 -> 4: training continues at the sample the checkpoint reached, and each step from "
            "there takes 4 samples") in plan.describe()
    assert "train_batch_size" not in plan_for(checkpoints["zero1"]).describe()


def test_other_data_says_what_the_position_does_to_it_and_a_moved_spelling_says_nothing(single_rank_world, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    root = tmp_path / "ckpt"
    saved_checkpoint(root, make_args(stage=0, data_path=str(data / "corpus_text_document")))
    plan = plan_for(root, stage=0, data_path=str(tmp_path / "other_text_document"))
    assert (f"data_path {str(data / 'corpus_text_document')!r} -> {str(tmp_path / 'other_text_document')!r}: training "
            "continues at sample 2 of the new data, skipping as many of its samples as the checkpoint had consumed "
            "of the old (the same ones if only the files moved); set `finetune: true` to start the new data at its "
            "first sample") in plan.describe()
    (tmp_path / "link").symlink_to(data)  # the same files reached another way: the position means what it meant
    assert "data_path" not in plan_for(root, stage=0, data_path=str(tmp_path / "link" / "corpus_text_document")).describe()
    assert "data_path" not in plan_for(root, stage=0, data_path=str(tmp_path / "other_text_document"),
                                       finetune=True).describe()


def test_another_pack_impl_says_what_the_position_does_to_the_samples(checkpoints):
    # the same data cut into other samples: the position is a count of the old ones (2 steps of 2 samples)
    assert ("pack_impl 'packed' -> 'unpacked': training continues at sample 4 of the new data"
            in plan_for(checkpoints["zero1"], pack_impl="unpacked").describe())


def test_a_tag_whose_client_state_counts_another_iteration_says_which_is_used(single_rank_world, tmp_path):
    root = _saved(tmp_path / "ckpt", iterations=(3,), iteration=2)
    plan = plan_for(root, stage=0)
    assert plan.saved_iteration == 2
    assert ("tag global_step3 records iteration 2 in its client state: training continues from iteration 2, the "
            "count its data position and LR schedule belong to") in plan.describe()


def test_a_checkpoint_that_read_no_data_yet_takes_any_seq_length(single_rank_world, tmp_path):
    # as the HF converter writes them: iteration 0, nothing consumed, seq_length from max_position_embeddings
    root = _saved(tmp_path / "ckpt", iterations=(1,), iteration=0, consumed_train_samples=0)
    plan = plan_for(root, stage=0, no_load_optim=True, seq_length=8)
    assert plan.data_position == DataPosition(0, 0) and "seq_length" not in plan.describe()


def test_a_resume_asking_for_another_number_of_samples_says_unpacked_samples_come_in_another_order(
        single_rank_world, tmp_path):
    root = tmp_path / "ckpt"
    saved_checkpoint(root, make_args(stage=0, pack_impl="unpacked", train_iters=12))
    plan = plan_for(root, stage=0, pack_impl="unpacked", train_iters=20)
    assert ("train_iters x train_batch_size 12 x 2 -> 20 x 2: with pack_impl unpacked the order of the samples is "
            "drawn for the run's 40 training samples, not the saved run's 24, so from sample 2 on this run reads "
            "other samples than the saved run would have (as in GPT-NeoX); keep both to continue exactly") \
        in plan.describe()
    assert "order of the samples" not in plan_for(root, stage=0, pack_impl="unpacked", train_iters=12).describe()
    saved_checkpoint(tmp_path / "packed", make_args(stage=0, train_iters=12))
    assert "order of the samples" not in plan_for(tmp_path / "packed", stage=0, train_iters=20).describe()


# --- LoRA adapter-only tags: the base comes from the source the tag records ----------------

def _adapter_tag(root, base_root):
    """A tag recording that it holds a LoRA run's adapters over `base_root`'s global_step2."""
    base = {"source": str(base_root), "tag": "global_step2",
            "checksum": plan_for(base_root, finetune=True, iteration=2).weights_checksum}
    return saved_checkpoint(root, make_args(stage=1, lora_rank=4), iterations=(1,),
                            client_state={**with_rng(), "lora_base": base})


@pytest.mark.parametrize("mode", [{}, {"finetune": True}])
def test_an_adapter_only_tag_plans_its_base_from_the_recorded_source(zero1_copy, tmp_path, mode):
    adapters = _adapter_tag(tmp_path / "adapters", zero1_copy)
    tag = inventory_checkpoint(adapters).tags["global_step1"]
    assert tag.saved_layout.adapters_only and tag.saved_layout.lora_base.path == zero1_copy / "global_step2"
    assert f"LoRA adapters only, over base {zero1_copy / 'global_step2'}" in tag.saved_layout.describe()
    plan = plan_for(adapters, lora_rank=4, **mode)
    assert plan.base.tag_dir == zero1_copy / "global_step2" and plan.base.module_only
    assert plan.load_optimizer == (not mode) and plan.lora_base == tag.saved_layout.lora_base  # its saves name it
    first, *lines = plan.describe().splitlines()
    assert first.endswith(f"LoRA adapters only, over the base {zero1_copy / 'global_step2'})")
    assert any(line.startswith(f"  base:   frozen weights from {zero1_copy / 'global_step2'}") for line in lines)
    assert "loaded: LoRA adapters" in plan.describe()


def test_an_adapter_only_tag_over_a_changed_or_missing_base_is_refused_naming_it(zero1_copy, tmp_path):
    adapters = _adapter_tag(tmp_path / "adapters", zero1_copy)
    base = zero1_copy / "global_step2"
    shutil.copy(zero1_copy / "global_step1" / "mp_rank_00_model_states.pt", base / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=f"base model of the LoRA adapters in {adapters / 'global_step1'}, "
                                              f"{base}, changed since the run started.*restore them at that path"):
        plan_for(adapters, lora_rank=4)
    shutil.rmtree(base)
    with pytest.raises(CheckpointError, match=f"{base}, is gone"):
        plan_for(adapters, lora_rank=4, finetune=True)


def test_an_adapter_only_tag_into_a_run_without_lora_is_refused(zero1_copy, tmp_path):
    adapters = _adapter_tag(tmp_path / "adapters", zero1_copy)
    with pytest.raises(CheckpointError, match="holds LoRA adapters only .*lora_rank 0.*lora_rank 4"):
        plan_for(adapters, finetune=True)


# --- a full resume that DeepSpeed would not make exact ------------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_16_bit_full_resume_that_would_rebuild_the_fp32_masters_from_16_bit_weights_is_refused(checkpoints,
                                                                                                  precision):
    zero = {"stage": 1, "load_from_fp32_weights": False}
    with pytest.raises(CheckpointError) as caught:
        plan_for(checkpoints["zero1"], precision=precision, zero_optimization=zero)
    message = str(caught.value)
    assert message.startswith("<dict>: zero_optimization.load_from_fp32_weights is false, so this full resume of ")
    assert f"from the {precision} weights instead of loading the saved fp32 copies" in message
    assert "remove the key" in message and "no_load_optim: true" in message and "\n" not in message


def test_load_from_fp32_weights_false_through_deepspeed_extra_args_is_refused_too(checkpoints):
    extra = {"zero_optimization": {"load_from_fp32_weights": False}}
    with pytest.raises(CheckpointError, match=r"^<dict>: zero_optimization\.load_from_fp32_weights is false"):
        plan_for(checkpoints["zero1"], precision="bf16", deepspeed_extra_args=extra)


def test_load_from_fp32_weights_false_is_harmless_where_no_fp32_master_is_rebuilt(checkpoints):
    zero = {"stage": 1, "load_from_fp32_weights": False}
    assert plan_for(checkpoints["zero1"], zero_optimization=zero).load_optimizer  # fp32: the weights are the masters
    plan = plan_for(checkpoints["zero1"], precision="bf16", zero_optimization=zero, no_load_optim=True)
    assert not plan.load_optimizer  # no optimizer states loaded: the masters are built from the weights anyway
