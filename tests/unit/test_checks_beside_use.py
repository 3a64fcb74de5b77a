"""Inside verified_files.checks_beside_use() a checkpoint file is checked in a thread while it is unpickled and
copied; the block ends with the checks, so a damaged file still stops the load before anything trains, with the
manifest's line, even where the damage made the reading fail first."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import layout, manifest
from megatron.checkpointing.ondisk.module_weights import load_checkpoint_file
from megatron.checkpointing.ondisk.verified_files import checks_beside_use, forget_checked_files


@pytest.fixture
def tag_file(tmp_path):
    tag_dir = tmp_path / "global_step1"
    tag_dir.mkdir()
    path = tag_dir / layout.model_states_name(0)
    torch.save({"module": {"w": torch.arange(1 << 20, dtype=torch.float32)}}, path)  # 4 MiB
    manifest.write_manifest(tag_dir, {path.name: manifest.record_file(path)})
    forget_checked_files()
    yield path
    forget_checked_files()


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_a_damaged_tensor_read_inside_the_block_stops_it_when_it_ends(tag_file):
    _flip_byte(tag_file, tag_file.stat().st_size // 2)  # inside the tensor's data: unpickling still works
    read = []
    with pytest.raises(CheckpointError, match=r"is damaged: its XXH3-64 differs"):
        with checks_beside_use():
            read.append(load_checkpoint_file(tag_file)["module"]["w"])
    assert len(read) == 1, "the file was read beside its check, not after it"
    with pytest.raises(CheckpointError, match="is damaged"):  # outside a block the check comes before the read
        load_checkpoint_file(tag_file)


def test_the_damage_is_reported_in_place_of_the_reading_error_it_caused(tag_file):
    with open(tag_file, "r+b") as handle:
        handle.truncate(tag_file.stat().st_size - 4096)  # the zip's directory is gone: torch.load fails
    with pytest.raises(CheckpointError) as raised:
        with checks_beside_use():
            load_checkpoint_file(tag_file)
    assert "bytes, but" in str(raised.value) and "recorded" in str(raised.value), str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_an_error_of_the_block_itself_passes_when_the_files_are_sound(tag_file):
    with pytest.raises(KeyError, match="not_there"):
        with checks_beside_use():
            load_checkpoint_file(tag_file)["module"]["not_there"]


def test_a_file_read_twice_and_in_a_nested_block_is_checked_once_when_the_outer_block_ends(tag_file, monkeypatch):
    checks = []
    check_open_file = manifest.check_open_file

    def counted(*args, **kwargs):
        checks.append(1)
        return check_open_file(*args, **kwargs)

    monkeypatch.setattr(manifest, "check_open_file", counted)
    _flip_byte(tag_file, tag_file.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="is damaged"):
        with checks_beside_use():
            with checks_beside_use():  # the reference model's load inside setup's block
                load_checkpoint_file(tag_file)
            load_checkpoint_file(tag_file)  # the nested block ended without raising: the outer one waits
    assert len(checks) == 1


def test_a_file_whose_check_runs_beside_its_read_is_not_read_again_for_its_problem(tag_file, monkeypatch):
    """A full resume asks for the problems of every file it reads after the load plan has read (and begun to
    check) the model-states file; with no launcher to share checks through (a rank run on its own), that
    answer comes from the check already begun, not from a second checksum pass over the file."""
    from megatron.checkpointing.ondisk import verified_files

    monkeypatch.setattr(verified_files, "_launch_marker_dir", lambda: None)
    passes = []
    check_open_file = manifest.check_open_file

    def counted(*args, **kwargs):
        passes.append(args[1])
        return check_open_file(*args, **kwargs)

    monkeypatch.setattr(manifest, "check_open_file", counted)
    with checks_beside_use():
        load_checkpoint_file(tag_file)
        assert verified_files.checkpoint_file_problem(tag_file) is None
    assert passes == [tag_file]

    _flip_byte(tag_file, tag_file.stat().st_size // 2)
    forget_checked_files()
    passes.clear()
    with pytest.raises(CheckpointError, match="is damaged"):
        with checks_beside_use():
            load_checkpoint_file(tag_file)
            assert "is damaged" in verified_files.checkpoint_file_problem(tag_file)
    assert passes == [tag_file]
