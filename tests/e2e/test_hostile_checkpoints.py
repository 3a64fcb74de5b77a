"""A checkpoint or HF folder whose file carries a pickled payload runs nothing, through every entry point.

The payload is an object whose ``__reduce__`` creates a marker file when the full unpickler reads it.
It goes into each kind of file (module states, client state, optimizer states, ZeRO-3 shard, GPT-NeoX
layer file, HF pytorch_model.bin), the tag's manifest is recomputed so the integrity check passes (an
attacker can: CRC is no signature), and every reader must refuse the file with one line naming it
while the marker never appears. Legitimate checkpoints of every precision and ZeRO stage still load.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from megatron.checkpointing import CheckpointError, load_checkpoint, plan_load, save_checkpoint
from megatron.checkpointing.ondisk import layout, manifest
from megatron.checkpointing.ondisk.client_state import ClientState
from megatron.checkpointing.ondisk.inventory import inventory_checkpoint
from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.checkpointing.ondisk.rng import collect_rng_states
from megatron.checkpointing.ondisk.safe_checkpoint_engine import use_weights_only_checkpoint_engine
from megatron.checkpointing.ondisk.safe_unpickle import every_torch_load_weights_only, load_weights_only
from megatron.checkpointing.saving.engine_save import save_engine_checkpoint
from megatron.hf import HF_FOLDER
from megatron.hf.convert import convert_hf_to_neox
from megatron.hf.folder_weights import read_hf_model
from tests import ckpt_engines
from tests.deepy_runs import run_deepy, write_overrides
from tests.e2e.test_hf_conversion import make_hf_model, run_tool, save_hf, tokens, write_pipeline_checkpoint
from tests.unit.test_hf_engine import build_engine, engine_args, engine_loss

REPO_ROOT = Path(__file__).resolve().parents[2]
REFUSED = "which loading it would have to run; it is not a file this trainer wrote or can trust"


class Payload:
    """Read by the full unpickler, it creates `marker`: the proof that a file ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def plant(path: Path, put, marker: Path) -> Path:
    """Put a Payload into the (trusted, freshly saved) file `path` with `put(state, payload)`; recompute the
    tag's manifest, where it has one, so the integrity check passes."""
    state = load_weights_only(path, mmap=False)  # not mapped: the same file is written next
    put(state, Payload(marker))
    torch.save(state, path)
    reseal(path.parent)
    return path


def reseal(tag_dir: Path) -> None:
    if (tag_dir / layout.MANIFEST_FILE).is_file():
        manifest.write_manifest(tag_dir, {name: manifest.record_file(tag_dir / name)
                                          for name in manifest.tag_file_names(tag_dir)})


def in_module(state, payload):
    state["module"]["payload"] = payload


def in_client_state(state, payload):
    state["rng_states"][0]["python"] = payload


def in_optimizer(state, payload):
    state["optimizer_state_dict"]["loss_scaler"] = payload


def in_zero3_shard(state, payload):
    state["param_shapes"] = [payload]


def in_weights(state, payload):
    state["payload"] = payload


def refused(err, path: Path) -> None:
    """Check the one line of a refused file (a CheckpointError's message or a tool's stderr line)."""
    message = str(err).strip()
    assert str(path) in message and REFUSED in message and "posix.system" in message, message
    assert len(message.splitlines()) == 1, message


def tool_error(result: subprocess.CompletedProcess) -> str:
    """The one error line of a tool that exited 1 (its stderr also holds the libraries' import warnings)."""
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0].removeprefix("error: ")


def copy_run(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(source, target)
    return target


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model("neox_parallel")


def _saved_run(root: Path, hf_model, stage: int) -> Path:
    args = engine_args(hf_model, "bf16", save=str(root), zero_optimization={"stage": stage})
    engine = build_engine(args)
    engine.backward(engine_loss(engine, tokens()))
    engine.step()
    save_checkpoint(args, engine, iteration=3, consumed_train_samples=6)
    return root


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory, hf_model, single_rank_world):
    return _saved_run(tmp_path_factory.mktemp("zero2") / "run", hf_model, 2)


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, hf_model, single_rank_world):
    return _saved_run(tmp_path_factory.mktemp("zero3") / "run", hf_model, 3)


def resume(hf_model, run: Path, stage: int):
    """A full resume of `run` on a fresh engine: the load plan, then DeepSpeed's load_checkpoint."""
    args = engine_args(hf_model, "bf16", load=str(run), zero_optimization={"stage": stage})
    plan = plan_load(args, 1, hf_source=HF_FOLDER)
    return load_checkpoint(build_engine(args), plan)


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.parametrize("stage, file_name, put", [
    (2, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", in_optimizer),
    (3, "zero_pp_rank_0_mp_rank_00_model_states.pt", in_zero3_shard),
    (3, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", in_optimizer),
], ids=["zero2-optimizer", "zero3-model-states-shard", "zero3-optimizer-shard"])
def test_full_resume_reads_through_deepspeed_weights_only(hf_model, zero2_run, zero3_run, tmp_path, stage,
                                                           file_name, put):
    run = copy_run(zero2_run if stage == 2 else zero3_run, tmp_path)
    path = plant(run / "global_step3" / file_name, put, tmp_path / "marker")
    with pytest.raises(CheckpointError) as caught:
        resume(hf_model, run, stage)
    refused(caught.value, path)
    assert not (tmp_path / "marker").exists()


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.parametrize("put", [in_module, in_client_state], ids=["module", "client-state"])
def test_deepspeeds_own_load_of_the_model_states_file_goes_through_our_engine(hf_model, zero2_run, tmp_path, put):
    """Past the load plan (which reads the same file itself): engine.load_checkpoint with our checkpoint engine."""
    run = copy_run(zero2_run, tmp_path)
    path = plant(run / "global_step3" / layout.model_states_name(0), put, tmp_path / "marker")
    engine = build_engine(engine_args(hf_model, "bf16"))
    use_weights_only_checkpoint_engine(engine)
    with pytest.raises(CheckpointError) as caught:
        engine.load_checkpoint(str(run), tag="global_step3")
    refused(caught.value, path)
    assert not (tmp_path / "marker").exists()


@pytest.mark.usefixtures("single_rank_world")
def test_the_load_plan_refuses_a_payload_in_the_client_state(hf_model, zero2_run, tmp_path):
    run = copy_run(zero2_run, tmp_path)
    path = plant(run / "global_step3" / layout.model_states_name(0), in_client_state, tmp_path / "marker")
    for read in (lambda: resume(hf_model, run, 2),
                 lambda: inventory_checkpoint(run).tags["global_step3"].metadata):
        with pytest.raises(CheckpointError) as caught:
            read()
        refused(caught.value, path)
    assert not (tmp_path / "marker").exists()


def test_module_only_reads_refuse_a_payload_in_the_module_a_layer_file_or_a_zero3_shard(hf_model, zero3_run,
                                                                                         tmp_path):
    converted = tmp_path / "converted"
    convert_hf_to_neox(save_hf(hf_model, tmp_path / "hf"), converted)
    module_file = plant(converted / "global_step0" / layout.model_states_name(0), in_module, tmp_path / "m1")
    pipeline = write_pipeline_checkpoint(read_module_weights(zero3_run / "global_step3"), tmp_path / "pipe", True)
    layer_file = plant(pipeline / "layer_03-model_00-model_states.pt", in_weights, tmp_path / "m2")
    shards = copy_run(zero3_run, tmp_path) / "global_step3"
    (shards / layout.model_states_name(0)).unlink()  # the module then comes from the ZeRO-3 shards
    shard_file = plant(shards / "zero_pp_rank_0_mp_rank_00_model_states.pt", in_zero3_shard, tmp_path / "m3")
    for tag_dir, path in ((converted / "global_step0", module_file), (pipeline, layer_file), (shards, shard_file)):
        with pytest.raises(CheckpointError) as caught:
            read_module_weights(tag_dir)
        refused(caught.value, path)
    assert not any((tmp_path / marker).exists() for marker in ("m1", "m2", "m3"))


@pytest.mark.slow
def test_a_payload_in_an_hf_bin_file_is_refused_by_the_load_and_convert_hf_to_neox(hf_model, tmp_path):
    hf_dir = save_hf(hf_model, tmp_path / "hf", fmt="bin")
    path = plant(hf_dir / "pytorch_model.bin", in_weights, tmp_path / "marker")
    with pytest.raises(CheckpointError) as caught:
        read_hf_model(hf_dir)
    refused(caught.value, path)
    refused(tool_error(run_tool("convert_hf_to_neox.py", "--input", str(hf_dir), "--output", str(tmp_path / "o"))),
            path)
    refused(tool_error(run_tool("inspect_checkpoint.py", str(hf_dir))), path)
    assert not (tmp_path / "marker").exists()


@pytest.mark.slow
def test_tools_and_deepy_dry_run_refuse_a_payload_in_the_client_state_or_a_layer_file(zero2_run, zero3_run,
                                                                                       tmp_path):
    run = copy_run(zero2_run, tmp_path)
    path = plant(run / "global_step3" / layout.model_states_name(0), in_client_state, tmp_path / "marker")
    pipeline = write_pipeline_checkpoint(read_module_weights(zero3_run / "global_step3"), tmp_path / "pipe", True)
    layer_file = plant(pipeline / "layer_02-model_00-model_states.pt", in_weights, tmp_path / "marker")
    for script, arguments, culprit in (
        ("inspect_checkpoint.py", [str(run)], path),
        ("inspect_checkpoint.py", [str(tmp_path / "pipe")], layer_file),
        ("convert_neox_to_hf.py", ["--input", str(run), "--output", str(tmp_path / "hf")], path),
    ):
        refused(tool_error(run_tool(script, *arguments)), culprit)

    # No model shape in the config: deepy.py takes it from the checkpoint's saved settings, before any rank starts.
    config = tmp_path / "finetune.yml"
    config.write_text(yaml.safe_dump({"load": str(run), "finetune": True, "train_iters": 2,
                                      "tokenizer_type": "ByteLevelTokenizer", "data_path": "data/x"}))
    result = subprocess.run([sys.executable, "deepy.py", "train.py", str(config), "--dry-run"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    refused(next(line for line in result.stderr.splitlines() if line.startswith("deepy.py: config error: load: ")),
            path)
    assert not (tmp_path / "marker").exists()


@pytest.mark.usefixtures("single_rank_world")
def test_a_payload_without_a_recomputed_manifest_is_refused_by_the_manifest_before_it_is_unpickled(
        hf_model, zero2_run, tmp_path):
    run = copy_run(zero2_run, tmp_path)
    tag_dir = run / "global_step3"
    for name, put in ((layout.model_states_name(0), in_module), ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                                  in_optimizer)):
        state = load_weights_only(tag_dir / name, mmap=False)
        put(state, Payload(tmp_path / "marker"))
        torch.save(state, tag_dir / name)
    with pytest.raises(CheckpointError) as caught:
        read_module_weights(tag_dir)
    assert str(caught.value).startswith(f"checkpoint file {tag_dir / layout.model_states_name(0)} has ")
    assert "recorded" in str(caught.value) and REFUSED not in str(caught.value)
    with pytest.raises(CheckpointError) as caught:
        resume(hf_model, run, 2)
    assert "recorded" in str(caught.value) and REFUSED not in str(caught.value)
    assert not (tmp_path / "marker").exists()


def test_code_that_asks_torch_for_the_full_unpickler_gets_the_weights_only_one_during_a_resume(tmp_path):
    """DeepSpeed's universal-checkpoint readers call torch.load(weights_only=False) themselves."""
    path = tmp_path / "fp32.pt"
    torch.save({"param": torch.ones(3), "payload": Payload(tmp_path / "marker")}, path)
    with pytest.raises(CheckpointError) as caught, every_torch_load_weights_only(tmp_path):
        torch.load(path, weights_only=False)
    assert f"a checkpoint file in {tmp_path} holds a reference to posix.system" in str(caught.value)
    assert not (tmp_path / "marker").exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


LEGITIMATE = [(precision, stage, offload) for precision in ("fp32", "bf16", "fp16") for stage in (0, 1, 2, 3)
              for offload in ((False, True) if stage in (2, 3) else (False,))]


@pytest.mark.usefixtures("single_rank_world", "fp16_capable_cpu")
@pytest.mark.parametrize("precision, stage, offload", LEGITIMATE,
                         ids=[f"{p}-zero{s}{'-offload' if o else ''}" for p, s, o in LEGITIMATE])
def test_every_file_of_a_legitimate_checkpoint_loads_weights_only(tmp_path, precision, stage, offload):
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    engine = ckpt_engines.build_engine(ckpt_engines.ds_config(precision, stage, zero=zero))
    ckpt_engines.train_step(engine, ckpt_engines.batch(1))
    args = ckpt_engines.make_args(stage, precision)
    client_state = ClientState(iteration=1, consumed_train_samples=2, settings=args.to_dict(),
                               rng_states=[collect_rng_states()]).to_dict()
    save_engine_checkpoint(engine, tmp_path, "global_step1", client_state)
    files = sorted((tmp_path / "global_step1").glob("*.pt"))
    assert len(files) >= 1 + (stage > 0)
    for path in files:
        assert isinstance(load_weights_only(path), dict)


def test_a_gpt_neox_model_states_file_with_its_rng_states_and_an_older_megatron_namespace_loads(tmp_path):
    """What GPT-NeoX writes next to the weights: numpy's generator state (a uint32 array) among its RNG states."""
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "iteration": 5, "args": argparse.Namespace(num_layers=2),
                "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state()}, path)
    state = load_weights_only(path)
    assert state["np_rng_state"][1].dtype == np.uint32 and state["args"].num_layers == 2


@pytest.mark.slow
def test_a_training_rank_refuses_it_in_the_load_plan_with_one_line(zero2_run, tmp_path):
    """The config gives the model's shape, so deepy.py reads nothing of the checkpoint: the rank's load plan does."""
    run = copy_run(zero2_run, tmp_path)
    path = plant(run / "global_step3" / layout.model_states_name(0), in_client_state, tmp_path / "marker")
    overrides = write_overrides(tmp_path, load=str(run), finetune=True, train_iters=2, num_gpus=1)
    result = run_deepy(["configs/tiny.yml", overrides], expect_success=False, timeout=600)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-4000:]
    lines = [line for line in result.stderr.splitlines() if str(path) in line]
    assert len(lines) == 1, result.stderr[-4000:]
    refused(lines[0], path)
    assert not (tmp_path / "marker").exists()
