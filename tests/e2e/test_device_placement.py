"""Nothing assumes a CPU where a GPU may be, checked on this CPU machine.

A checkpoint written on GPUs records the device of every tensor (`cuda:0`, `cuda:3`, ...), and
torch.load without a map_location puts each one back there: on a CPU machine it fails, on a GPU
machine every rank would fill the saving rank's GPU. Here the files of a real checkpoint are
rewritten with their tensors tagged `cuda:0`, exactly as a GPU run's files are, and the run
resumes and fine-tunes from them: every reader on the way (ours and DeepSpeed's) must map to the
CPU. Device names come from DeepSpeed's accelerator, never spelled in the code.
"""

from __future__ import annotations

import ast
import contextlib
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.serialization

from megatron.checkpointing.ondisk.manifest import record_file, tag_file_names, write_manifest
from megatron.checkpointing.ondisk.rng import collect_rng_states, restore_rng_states
from megatron.checkpointing.ondisk.safe_checkpoint_engine import WeightsOnlyCheckpointEngine
from megatron.checkpointing.ondisk.safe_unpickle import load_weights_only
from tests.deepy_runs import REPO_ROOT, run_deepy, train_lines, write_overrides

GPU_LOCATION = "cuda:0"


@contextlib.contextmanager
def tensors_saved_as_on_a_gpu():
    """Within the block torch.save tags every CPU tensor's storage `cuda:0`, as a GPU's storages are tagged."""
    def tagger(storage):
        return GPU_LOCATION if getattr(storage, "device", None) is not None and storage.device.type == "cpu" else None

    torch.serialization.register_package(1, tagger, lambda storage, location: None)
    try:
        yield
    finally:
        registry = torch.serialization._package_registry
        registry[:] = [entry for entry in registry if entry[1] is not tagger]


def rewrite_as_saved_on_a_gpu(tag_dir: Path) -> list[Path]:
    """Every .pt file of `tag_dir` written again with its tensors tagged `cuda:0`; the manifest follows."""
    rewritten = sorted(tag_dir.glob("*.pt"))
    for path in rewritten:
        content = load_weights_only(path, mmap=False)
        with tensors_saved_as_on_a_gpu():
            torch.save(content, path)
    write_manifest(tag_dir, {name: record_file(tag_dir / name) for name in tag_file_names(tag_dir)})
    return rewritten


def test_a_gpu_tagged_file_is_what_a_cpu_machine_cannot_load_unmapped(tmp_path):
    """The rewrite really makes GPU files: unmapped, torch refuses them here (so the tests below can fail)."""
    path = tmp_path / "w.pt"
    with tensors_saved_as_on_a_gpu():
        torch.save({"w": torch.arange(6.0)}, path)
    with pytest.raises(RuntimeError, match="CUDA device"):
        torch.load(path, weights_only=True)
    assert torch.equal(load_weights_only(path)["w"], torch.arange(6.0))


@pytest.mark.parametrize("map_location", ["cpu", torch.device("cpu"), lambda storage, location: storage],
                         ids=["'cpu'", "torch.device", "keep-storage callable"])
def test_the_weights_only_engine_maps_to_the_cpu_as_deepspeed_asks(tmp_path, map_location):
    """The map_locations DeepSpeed 0.16-0.19 pass to its checkpoint engine's load."""
    path = tmp_path / "w.pt"
    with tensors_saved_as_on_a_gpu():
        torch.save({"w": torch.arange(6.0)}, path)
    loaded = WeightsOnlyCheckpointEngine(None).load(str(path), map_location=map_location)
    assert loaded["w"].device.type == "cpu" and torch.equal(loaded["w"], torch.arange(6.0))


@pytest.mark.slow
@pytest.mark.e2e
def test_a_checkpoint_saved_on_gpus_resumes_and_fine_tunes_on_a_cpu(tmp_path):
    save = tmp_path / "ckpt"
    settings = dict(save=str(save), train_iters=2, lr_decay_iters=10, checkpoint_factor=2, eval_interval=1000)
    run_deepy(["configs/tiny.yml", write_overrides(tmp_path, name="train.yml", **settings)])
    rewritten = rewrite_as_saved_on_a_gpu(save / "global_step2")
    assert {path.name for path in rewritten} >= {"mp_rank_00_model_states.pt",
                                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt"}

    resume = write_overrides(tmp_path, name="resume.yml", **{**settings, "load": str(save), "train_iters": 3})
    assert train_lines(run_deepy(["configs/tiny.yml", resume]).stdout)[0].iteration == 3
    tune = write_overrides(tmp_path, name="tune.yml", load=str(save), save=str(tmp_path / "tuned"), finetune=True,
                           train_iters=1, checkpoint_factor=1, eval_interval=1000)
    assert train_lines(run_deepy(["configs/tiny.yml", tune]).stdout)[0].iteration == 1


def test_rng_states_saved_on_a_gpu_restore_on_a_cpu():
    """A GPU rank's states carry the accelerator's generator too; a CPU rank restores the rest exactly."""
    states = collect_rng_states()
    assert "accelerator" not in states  # the CPU accelerator has no generator of its own
    gpu_states = {**states, "accelerator": torch.get_rng_state()}  # what CUDA's get_rng_state returns: a CPU ByteTensor
    expected = (random.random(), np.random.rand(), torch.rand(1))
    restore_rng_states(gpu_states)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


# A device spelled in the code: `.cuda()`, or a string naming an accelerator ("cuda", "cuda:1", "xpu", ...).
SPELLED_DEVICE = re.compile(r"^(cuda|xpu|hpu|npu|mps|mlu)(:\d+)?$")


def test_no_module_spells_a_device_name():
    """Device names come from DeepSpeed's accelerator (get_accelerator().current_device_name()). The torch.cuda
    module itself stays allowed where a feature is CUDA's own (memory_profiling's allocation history)."""
    found = []
    for path in sorted([*(REPO_ROOT / "megatron").rglob("*.py"), REPO_ROOT / "train.py", REPO_ROOT / "generate.py"]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SPELLED_DEVICE.match(node.value):
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {node.value!r}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("cuda", "pin_memory")):  # tensor.cuda(), tensor.pin_memory()
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: .{node.func.attr}()")
    assert not found, found
