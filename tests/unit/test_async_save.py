"""async_save: the tag written in the background holds the state of the moment of the save, and a
background write that fails stops training at the next step in one line, keeping the previous tag.

Real DeepSpeed engines and real files. The background writer is held back (its checkpoint engine's
save waits for an event) so that a training step surely changes the weights, the master and the
optimizer state before the files are written; the expected files are a synchronous save of the same
state, written by DeepSpeed's own checkpoint engine.
"""

from __future__ import annotations

import resource
import threading
from pathlib import Path

import pytest
import torch

from megatron.checkpointing import (
    CheckpointError,
    check_save_in_flight,
    save_checkpoint,
    saves_waited_for,
    wait_for_save_in_flight,
)
from megatron.checkpointing.ondisk import client_state, layout, manifest
from megatron.checkpointing.ondisk.safe_unpickle import load_weights_only
from megatron.checkpointing.saving.async_save import save_in_flight
from tests.ckpt_engines import build_engine, make_args, tiny_batch, train_step

CONFIGS = {"tiny.yml": "num_layers: 2\n"}
SETTINGS_KEY = client_state.SETTINGS_KEY  # the run's settings: its save directory differs


def args_for(directory: Path, stage: int, precision: str, asynchronous: bool):
    return make_args(stage=stage, precision=precision, save=str(directory), config_files=CONFIGS,
                     async_save=asynchronous)


class HeldWriter:
    """Holds every write of `engine`'s checkpoint engine until `release()`."""

    def __init__(self, engine):
        self.writer = engine.checkpoint_engine
        self.released = threading.Event()
        original = self.writer.save

        def held(state_dict, path):
            self.released.wait()
            return original(state_dict, path)

        self.writer.save = held

    def release(self) -> None:
        self.released.set()

    def remove(self) -> None:
        self.released.set()
        del self.writer.save  # the class's method again


@pytest.fixture
def in_training_loop():
    """As inside the training loop, which waits for every save it starts: async_save saves go to the background."""
    with saves_waited_for():
        yield


def assert_same_content(expected, actual, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and expected.dtype == actual.dtype, where
        assert expected.shape == actual.shape and torch.equal(expected.view(-1).view(torch.uint8),
                                                              actual.reshape(-1).view(torch.uint8)), where
    elif isinstance(expected, dict):
        assert set(expected) == set(actual), where
        for key in expected:
            if key != SETTINGS_KEY:
                assert_same_content(expected[key], actual[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for index, (a, b) in enumerate(zip(expected, actual, strict=True)):
            assert_same_content(a, b, f"{where}[{index}]")
    elif hasattr(expected, "__dict__"):  # a record such as DeepSpeed's loss scaler
        assert type(expected) is type(actual), where
        assert_same_content(vars(expected), vars(actual), where)
    else:
        assert expected == actual, where


@pytest.mark.parametrize("stage, precision", [(1, "bf16"), (0, "fp32"), (3, "fp32")])
def test_the_background_save_holds_the_state_of_the_moment_of_the_save(single_rank_world, in_training_loop, tmp_path,
                                                                        stage, precision):
    synchronous = args_for(tmp_path / "synchronous", stage, precision, asynchronous=False)
    asynchronous = args_for(tmp_path / "asynchronous", stage, precision, asynchronous=True)
    engine = build_engine(synchronous)
    train_step(engine, tiny_batch(synchronous, 1))
    save_checkpoint(synchronous, engine, 1, 2)
    held = HeldWriter(engine)
    try:
        save_checkpoint(asynchronous, engine, 1, 2)
        before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        train_step(engine, tiny_batch(synchronous, 2))  # changes what the save was given, before it is written
        assert any(not torch.equal(before[name], p) for name, p in engine.module.named_parameters())
        assert not (tmp_path / "asynchronous" / "latest").exists()
        held.release()
        wait_for_save_in_flight()
    finally:
        held.remove()

    expected_dir, actual_dir = tmp_path / "synchronous" / "global_step1", tmp_path / "asynchronous" / "global_step1"
    assert (tmp_path / "asynchronous" / "latest").read_text() == "global_step1"
    names = manifest.tag_file_names(expected_dir)
    assert manifest.tag_file_names(actual_dir) == names
    manifest.verify_files(actual_dir, [actual_dir / name for name in names])
    for name in names:
        if not name.endswith(".pt"):
            continue
        expected = load_weights_only(expected_dir / name)
        if SETTINGS_KEY not in expected:  # optimizer shards: the very bytes, storage sharing included
            assert (actual_dir / name).read_bytes() == (expected_dir / name).read_bytes(), name
        assert_same_content(expected, load_weights_only(actual_dir / name), name)


def test_a_failed_background_write_stops_training_at_the_next_step_and_keeps_the_previous_tag(
        single_rank_world, in_training_loop, tmp_path):
    args = args_for(tmp_path / "checkpoints", 1, "fp32", asynchronous=True)
    save_dir = tmp_path / "checkpoints"
    engine = build_engine(args)
    train_step(engine, tiny_batch(args, 1))
    save_checkpoint(args, engine, 1, 2)
    wait_for_save_in_flight()
    train_step(engine, tiny_batch(args, 2))
    held = HeldWriter(engine)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    steps_after_the_save = 0
    try:
        save_checkpoint(args, engine, 2, 4)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # a real limit: the files are larger
        held.release()
        with pytest.raises(CheckpointError) as raised:
            while steps_after_the_save < 200:
                steps_after_the_save += 1
                train_step(engine, tiny_batch(args, 2 + steps_after_the_save))
                check_save_in_flight()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        held.remove()
    line = str(raised.value)
    assert "\n" not in line
    assert "global_step2" in line and "file-size limit" in line, line
    assert f"The run stopped; {save_dir / 'global_step1'} is intact." in line
    assert layout.read_latest(save_dir) == "global_step1"
    assert sorted(p.name for p in save_dir.iterdir() if p.is_dir()) == ["global_step1"]
    tag = save_dir / "global_step1"
    manifest.verify_files(tag, [tag / name for name in manifest.tag_file_names(tag)])
    check_save_in_flight()  # nothing in flight any more: no error twice


def record_host_memory_written(engine, found: set[int]) -> None:
    """Add to `found` the address of every storage the engine's checkpoint engine writes a tensor from (for an
    asynchronous save: the host copies); until the instance's `save` is removed."""
    writer = engine.checkpoint_engine
    original = writer.save

    def walk(value):
        if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes():
            found.add(value.untyped_storage().data_ptr())
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    def recording(state_dict, path):
        walk(state_dict)
        return original(state_dict, path)

    writer.save = recording


def test_a_later_save_copies_into_the_host_memory_of_the_one_before_and_holds_its_own_moment(
        single_rank_world, in_training_loop, tmp_path):
    synchronous = args_for(tmp_path / "synchronous", 1, "bf16", asynchronous=False)
    asynchronous = args_for(tmp_path / "asynchronous", 1, "bf16", asynchronous=True)
    engine = build_engine(synchronous)
    first, second = set(), set()
    try:
        train_step(engine, tiny_batch(synchronous, 1))
        record_host_memory_written(engine, first)
        save_checkpoint(asynchronous, engine, 1, 2)
        wait_for_save_in_flight()
        vars(engine.checkpoint_engine).pop("save")
        train_step(engine, tiny_batch(synchronous, 2))
        save_checkpoint(synchronous, engine, 2, 4)
        record_host_memory_written(engine, second)
        held = HeldWriter(engine)
        try:
            save_checkpoint(asynchronous, engine, 2, 4)
            train_step(engine, tiny_batch(synchronous, 3))  # changes what the copies were taken from
            held.release()
            wait_for_save_in_flight()
        finally:
            held.remove()
    finally:
        vars(engine.checkpoint_engine).pop("save", None)  # the class's method again
    assert first and second == first, "the second save copies into the first one's host memory"
    expected_dir, actual_dir = tmp_path / "synchronous" / "global_step2", tmp_path / "asynchronous" / "global_step2"
    names = manifest.tag_file_names(expected_dir)
    manifest.verify_files(actual_dir, [actual_dir / name for name in names])
    for name in names:
        if name.endswith(".pt"):
            assert_same_content(load_weights_only(expected_dir / name), load_weights_only(actual_dir / name), name)


def test_outside_the_training_loop_an_async_save_is_written_before_it_returns(single_rank_world, tmp_path):
    """Nothing would wait for a background save there (a tool, a script): the tag is committed on return."""
    args = args_for(tmp_path / "checkpoints", 1, "bf16", asynchronous=True)
    engine = build_engine(args)
    train_step(engine, tiny_batch(args, 1))
    save_checkpoint(args, engine, 1, 2)
    assert not save_in_flight()
    tag = tmp_path / "checkpoints" / "global_step1"
    assert layout.read_latest(tmp_path / "checkpoints") == "global_step1"
    manifest.verify_files(tag, [tag / name for name in manifest.tag_file_names(tag)])
