"""save_checkpoint -> plan_load -> load_checkpoint with real DeepSpeed engines, per row of the load table."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from deepspeed import zero

from megatron.checkpointing import (
    CheckpointError,
    Lineage,
    LoadMode,
    load_checkpoint,
    plan_load,
    save_checkpoint,
)
from megatron.checkpointing.ondisk.rng import collect_rng_states, restore_rng_states
from megatron.hf import HF_FOLDER
from tests.ckpt_engines import (
    build_engine,
    ds_config,
    hf_settings,
    make_args,
    tiny_batch,
    tiny_hf_model,
    train_step,
)

CONFIGS = {"tiny.yml": "num_layers: 2\nhidden_size: 8\n", "local_setup.yml": "save: checkpoints\n"}


def full_weights(engine) -> dict[str, torch.Tensor]:
    params = list(engine.module.parameters())
    with zero.GatheredParameters(params):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def run_args(tmp_path, stage=1, precision="fp32", **settings):
    directory = str(tmp_path / "checkpoints")
    return make_args(stage=stage, precision=precision, save=directory, load=directory, config_files=CONFIGS,
                     **settings)


def trained_and_saved(args, steps=2):
    """An engine trained `steps` steps and saved at the last one; returns it to continue training."""
    engine = build_engine(args, seed=0)
    for step in range(1, steps + 1):
        train_step(engine, tiny_batch(args, step))
    save_checkpoint(args, engine, steps, consumed_train_samples=2 * steps)
    return engine


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_continues_exactly_like_the_uninterrupted_run(single_rank_world, fp16_capable_cpu, tmp_path, stage,
                                                             precision):
    args = run_args(tmp_path, stage, precision)
    original = trained_and_saved(args)
    train_step(original, tiny_batch(args, 3))  # dropout draws from the RNG state saved at iteration 2
    expected = full_weights(original)

    plan = plan_load(args, data_parallel_size=1)
    assert plan.mode is LoadMode.RESUME and plan.tag == "global_step2"
    resumed = build_engine(args, seed=1)  # other initial weights: only the checkpoint can make them equal
    torch.manual_seed(999)  # and another RNG state: only the restore can give the same dropout mask
    outcome = load_checkpoint(resumed, plan)
    assert (outcome.iteration, outcome.consumed_train_samples) == (2, 4)
    assert outcome.loaded_optimizer and outcome.restored_rng and outcome.tag == "global_step2"
    train_step(resumed, tiny_batch(args, 3))
    for name, value in full_weights(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


def test_resume_without_rng_restore_differs(single_rank_world, tmp_path):
    """The check above can fail: with no_load_rng the dropout mask, hence the step, differs."""
    args = run_args(tmp_path, no_load_rng=True)
    original = trained_and_saved(args)
    train_step(original, tiny_batch(args, 3))
    expected = full_weights(original)
    resumed = build_engine(args, seed=1)
    torch.manual_seed(999)
    outcome = load_checkpoint(resumed, plan_load(args, 1))
    assert outcome.loaded_optimizer and not outcome.restored_rng
    train_step(resumed, tiny_batch(args, 3))
    assert any(not torch.equal(v, expected[k]) for k, v in full_weights(resumed).items())


@pytest.mark.parametrize("mode, stage, precision",
                         [("no_load_optim", 2, "bf16"), ("finetune", 2, "bf16"), ("finetune", 3, "fp32")])
def test_module_only_modes(single_rank_world, tmp_path, mode, stage, precision):
    args = run_args(tmp_path, stage=stage, precision=precision, **{mode: True})
    original = trained_and_saved(args)
    saved = full_weights(original)
    torch.manual_seed(7)
    rng_after_save_elsewhere = torch.rand(1)

    fresh = build_engine(args, seed=1)
    plan = plan_load(args, 1)
    assert all("optim_states" not in p.name for p in plan.files)
    torch.manual_seed(999)
    outcome = load_checkpoint(fresh, plan)
    for name, value in full_weights(fresh).items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
    assert not outcome.loaded_optimizer
    assert not fresh.optimizer.optimizer.state  # the wrapped Adam has taken no step
    if mode == "no_load_optim":
        assert (outcome.iteration, outcome.consumed_train_samples, outcome.restored_rng) == (2, 4, True)
    else:
        assert (outcome.iteration, outcome.consumed_train_samples, outcome.restored_rng) == (0, 0, False)
        torch.manual_seed(7)
        assert torch.equal(torch.rand(1), rng_after_save_elsewhere)  # generators left alone


@pytest.mark.parametrize("stage, precision", [(0, "bf16"), (2, "fp32"), (3, "fp32")])
def test_no_save_optim_saves_weights_only_and_a_resume_starts_a_fresh_optimizer(single_rank_world, tmp_path, stage,
                                                                                 precision):
    """Without ZeRO (a bf16 optimizer writes both kinds), under ZeRO-2 and under ZeRO-3 (the full module file)."""
    args = run_args(tmp_path, stage=stage, precision=precision, no_save_optim=True)
    original = trained_and_saved(args)
    saved = full_weights(original)
    tag_dir = tmp_path / "checkpoints" / "global_step2"
    written = sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*") if p.is_file())
    assert not any("optim_states" in name for name in written), written
    assert not (tmp_path / "checkpoints" / "zero_to_fp32.py").exists()  # it reads optimizer shards
    state = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=True)
    assert state["optimizer"] is None and state["module"]  # the layout GPT-NeoX's converter reads
    recorded = json.loads((tag_dir / "manifest.json").read_text())["files"]
    assert sorted(recorded) == [name for name in written if name != "manifest.json"]

    plan = plan_load(run_args(tmp_path, stage=stage, precision=precision), data_parallel_size=1)  # a full resume
    assert plan.mode is LoadMode.NO_LOAD_OPTIM and not plan.load_optimizer
    fresh_lines = [line for line in plan.describe().splitlines() if "optimizer starts fresh" in line]
    assert len(fresh_lines) == 1 and "no_save_optim" in fresh_lines[0]
    resumed = build_engine(args, seed=1)
    outcome = load_checkpoint(resumed, plan)
    assert (outcome.iteration, outcome.consumed_train_samples, outcome.restored_rng) == (2, 4, True)
    assert not outcome.loaded_optimizer and plan.lr_schedule_start == 2  # a fresh schedule, warmup included
    for name, value in full_weights(resumed).items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)


def test_zero3_shards_without_module_file_finetune(single_rank_world, tmp_path):
    """A ZeRO-3 tag saved by DeepSpeed alone: the weights are rebuilt from its fp32 partitions."""
    args = run_args(tmp_path, stage=3, finetune=True)
    original = build_engine(args, seed=0)
    train_step(original, tiny_batch(args, 1))
    original.save_checkpoint(args.save, tag="global_step1")
    saved = full_weights(original)
    plan = plan_load(args, 1)
    assert plan.source_format == "zero3"
    fresh = build_engine(args, seed=1)
    outcome = load_checkpoint(fresh, plan)
    assert outcome.iteration == 0
    for name, value in full_weights(fresh).items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)


def test_finetune_from_hugging_face_dir_gives_the_same_logits(single_rank_world, tmp_path):
    import deepspeed

    from megatron.model import build_model

    hf_dir = tiny_hf_model(tmp_path / "hf")
    args = make_args(stage=1, finetune=True, load=str(hf_dir), **hf_settings(hf_dir))
    plan = plan_load(args, 1, hf_source=HF_FOLDER)
    model = build_model(args.architecture(), args.seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args.precision, args.zero_stage))
    outcome = load_checkpoint(engine, plan)
    assert (outcome.iteration, outcome.loaded_optimizer, outcome.tag) == (0, False, None)

    from transformers import GPTNeoXForCausalLM

    tokens = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(0))
    engine.eval()
    with torch.no_grad():
        ours = engine(tokens).float()
        theirs = GPTNeoXForCausalLM.from_pretrained(hf_dir).eval()(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_forward_pass_validation_runs_on_save_and_load(single_rank_world, tmp_path):
    import deepspeed

    from megatron.checkpointing.ondisk.client_state import FORWARD_VALIDATION_KEY
    from megatron.model import build_model

    def gpt_engine(args):
        model = build_model(args.architecture(), args.seed)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(args.precision, args.zero_stage))
        return engine

    settings = dict(finetune=True, checkpoint_validation_with_forward_pass=True, seq_length=16)
    args = run_args(tmp_path, **settings)
    tag_dir = save_checkpoint(args, gpt_engine(args), 1, 2)
    other_init = run_args(tmp_path, seed=5, **settings)
    assert load_checkpoint(gpt_engine(other_init), plan_load(args, 1)).tag == "global_step1"

    # logits that the saved weights do not produce must stop the load; without the manifest, which
    # would refuse the rewritten file before the forward pass could
    path = tag_dir / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    state[FORWARD_VALIDATION_KEY]["logits"] += 1.0
    torch.save(state, path)
    (tag_dir / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="forward-pass validation of .*global_step1 failed"):
        load_checkpoint(gpt_engine(args), plan_load(args, 1))


def test_save_writes_configs_latest_and_prunes(single_rank_world, tmp_path):
    args = run_args(tmp_path, keep_last_n_checkpoints=2)
    engine = build_engine(args)
    root = tmp_path / "checkpoints"
    lineage = Lineage()  # the run's own tags, which pruning may delete
    for step in (1, 2, 3):
        train_step(engine, tiny_batch(args, step))
        tag_dir = save_checkpoint(args, engine, step, 2 * step, lr_schedule_start=1, lineage=lineage)
        assert tag_dir == root / f"global_step{step}"
        assert (root / "latest").read_text() == f"global_step{step}"
    kept = sorted(p.name for p in root.iterdir() if p.is_dir())  # DeepSpeed adds zero_to_fp32.py etc.
    assert kept == ["global_step2", "global_step3"]
    for name, text in CONFIGS.items():
        assert (root / "global_step3" / "configs" / name).read_text() == text
    client = torch.load(root / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)
    assert (client["iteration"], client["consumed_train_samples"]) == (3, 6)
    assert client["args"]["hidden_size"] == args.hidden_size and len(client["rng_states"]) == 1
    assert (client["checkpoint_format_version"], client["lr_schedule_start_iteration"]) == (2, 1)


def test_auto_resume_first_run_loads_nothing(single_rank_world, tmp_path):
    args = run_args(tmp_path)
    plan = plan_load(args, 1)
    assert plan.nothing_to_load
    assert load_checkpoint(build_engine(args), plan) is None


def test_silently_not_loaded_is_an_error(single_rank_world, tmp_path):
    args = run_args(tmp_path, stage=0)
    trained_and_saved(args)
    plan = plan_load(args, 1)
    engine = build_engine(args, seed=1)
    # DeepSpeed reports "nothing loaded" as (None, None) rather than raising; stand in for a tag
    # that vanished between the plan and the load.
    engine.load_checkpoint = lambda *a, **k: (None, None)
    with pytest.raises(CheckpointError, match="did not load .*global_step2"):
        load_checkpoint(engine, plan)


def test_rng_states_round_trip():
    states = collect_rng_states()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(5)  # move every generator on
    restore_rng_states(states)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_rng_states_survive_weights_only_load(tmp_path):
    torch.save(collect_rng_states(), tmp_path / "rng.pt")
    states = torch.load(tmp_path / "rng.pt", weights_only=True)
    expected = torch.rand(2), np.random.rand()
    restore_rng_states(states)
    assert torch.equal(torch.rand(2), expected[0]) and np.random.rand() == expected[1]


def test_incomplete_rng_states_are_refused():
    with pytest.raises(CheckpointError, match="numpy.*no_load_rng"):
        restore_rng_states({"python": random.getstate(), "torch_cpu": torch.get_rng_state()})


def test_a_non_strict_load_says_what_it_skipped(single_rank_world, tmp_path):
    import logging

    from megatron.logging import get_logger

    args = run_args(tmp_path, stage=0, finetune=True, load_module_strict=False)
    tag_dir = save_checkpoint(args, build_engine(args, seed=0), 1, 2)
    path = tag_dir / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    del state["module"]["out.bias"]
    state["module"]["head.weight"] = torch.zeros(3)
    torch.save(state, path)
    (tag_dir / "manifest.json").unlink()  # which would refuse the edited file as damaged

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    get_logger().addHandler(handler)
    try:
        outcome = load_checkpoint(build_engine(args, seed=1), plan_load(args, 1))
    finally:
        get_logger().removeHandler(handler)
    report = outcome.module_report
    assert (report.missing, report.unexpected) == (["out.bias"], ["head.weight"])
    skipped = [r.getMessage() for r in records if "out.bias" in r.getMessage()]
    assert len(skipped) == 1 and "head.weight" in skipped[0]
