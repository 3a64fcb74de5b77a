"""Saves that are complete or never offered, checksums that catch damage inside files, lineage-aware pruning.

Real DeepSpeed engines and real files; the damage is real bytes overwritten inside a saved file.
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import xxhash

from megatron.checkpointing import CheckpointError, LoadMode, load_checkpoint, plan_load, save_checkpoint
from megatron.checkpointing.saving import commit
from tests.ckpt_engines import build_engine, make_args, tiny_batch, train_step
from tests.deepy_runs import REPO_ROOT

CONFIGS = {"tiny.yml": "num_layers: 2\n"}


def run_args(tmp_path, stage=1, **settings):
    directory = str(tmp_path / "checkpoints")
    return make_args(stage=stage, save=directory, load=directory, config_files=CONFIGS, **settings)


def save_steps(args, steps, engine=None, lineage=None):
    engine = engine or build_engine(args)
    for step in steps:
        train_step(engine, tiny_batch(args, step))
        save_checkpoint(args, engine, step, 2 * step, lineage=lineage)
    return engine


def overwrite_inside_largest_tensor(path: Path, fill: bytes = b"\0") -> None:
    """Overwrite the middle of the largest tensor stored in a torch zip file, leaving the zip
    structure, the pickled objects and the file size as they were: damage only a checksum can see."""
    with zipfile.ZipFile(path) as archive:
        tensors = [info for info in archive.infolist() if "/data/" in info.filename]
        entry = max(tensors, key=lambda info: info.file_size)
    with open(path, "r+b") as handle:
        handle.seek(entry.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", handle.read(4))
        start = entry.header_offset + 30 + name_length + extra_length
        length = min(64 * 1024, entry.file_size // 2)
        handle.seek(start + entry.file_size // 4)
        handle.write(fill * length)


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_save_writes_a_manifest_of_every_file_and_leaves_no_partial_folder(single_rank_world, tmp_path):
    args = run_args(tmp_path)
    save_steps(args, [1])
    root = tmp_path / "checkpoints"
    tag_dir = root / "global_step1"
    stored = json.loads((tag_dir / "manifest.json").read_text())
    assert stored["manifest_version"] == 3
    recorded = stored["files"]
    on_disk = sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*")
                     if p.is_file() and p.name != "manifest.json")
    assert sorted(recorded) == on_disk and "configs/tiny.yml" in on_disk
    for name, entry in recorded.items():
        data = (tag_dir / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    assert not [p for p in root.iterdir() if p.name.endswith(".partial")]
    assert (root / "latest").read_text() == "global_step1"


@pytest.mark.parametrize("stage, finetune, damaged", [
    (1, True, "mp_rank_00_model_states.pt"),  # module-only path
    (1, False, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),  # DeepSpeed's resume, ZeRO shard
    (0, False, "mp_rank_00_model_states.pt"),  # DeepSpeed's resume, optimizer inside the model file
    (3, False, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),  # DeepSpeed's resume, ZeRO-3 shard
])
def test_damage_inside_a_file_is_refused_naming_it_and_the_older_tag_still_loads(
        single_rank_world, tmp_path, stage, finetune, damaged):
    args = run_args(tmp_path, stage=stage, finetune=finetune)
    save_steps(args, [1, 2])
    tag_dir = tmp_path / "checkpoints" / "global_step2"
    overwrite_inside_largest_tensor(tag_dir / damaged)
    with pytest.raises(CheckpointError, match="is damaged") as raised:  # the plan reads the model-states file
        load_checkpoint(build_engine(args, seed=1), plan_load(args, 1))
    assert str(tag_dir / damaged) in one_line(raised)
    older = run_args(tmp_path, stage=stage, finetune=finetune, iteration=1)
    assert load_checkpoint(build_engine(older, seed=1), plan_load(older, 1)).tag == "global_step1"


# The manifests earlier saves wrote: version 1 (SHA-256), version 2 (CRC-32).
EARLIER_MANIFESTS = {
    "sha256": (1, "SHA-256", lambda data: hashlib.sha256(data).hexdigest()),
    "crc32": (2, "CRC-32", lambda data: f"{zlib.crc32(data):08x}"),
}


@pytest.mark.parametrize("checksum", sorted(EARLIER_MANIFESTS))
@pytest.mark.parametrize("finetune", [True, False], ids=["module-only", "resume"])
def test_a_manifest_of_an_earlier_save_still_verifies_and_catches_damage(single_rank_world, tmp_path, finetune,
                                                                          checksum):
    version, shown, digest = EARLIER_MANIFESTS[checksum]
    args = run_args(tmp_path, finetune=finetune)
    save_steps(args, [1])
    tag_dir = tmp_path / "checkpoints" / "global_step1"
    files = {path.relative_to(tag_dir).as_posix(): path.read_bytes() for path in tag_dir.rglob("*")
             if path.is_file() and path.name != "manifest.json"}
    earlier = {"manifest_version": version, "files": {name: {"size": len(data), checksum: digest(data)}
                                                       for name, data in files.items()}}
    (tag_dir / "manifest.json").write_text(json.dumps(earlier))
    assert load_checkpoint(build_engine(args, seed=1), plan_load(args, 1)).tag == "global_step1"

    overwrite_inside_largest_tensor(tag_dir / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=f"is damaged: its {shown} differs") as raised:
        load_checkpoint(build_engine(args, seed=1), plan_load(args, 1))
    assert str(tag_dir / "mp_rank_00_model_states.pt") in one_line(raised)


def test_without_the_manifest_the_same_damage_loads_silently(single_rank_world, tmp_path):
    """What the checksums are for: torch reads overwritten tensor bytes without complaint."""
    args = run_args(tmp_path, finetune=True)
    save_steps(args, [1])
    tag_dir = tmp_path / "checkpoints" / "global_step1"
    overwrite_inside_largest_tensor(tag_dir / "mp_rank_00_model_states.pt")
    (tag_dir / "manifest.json").unlink()
    plan = plan_load(args, 1)
    assert any("no manifest.json" in note for note in plan.notes)
    assert load_checkpoint(build_engine(args, seed=1), plan).tag == "global_step1"


def test_interrupted_save_is_skipped_and_removed_by_the_next_save(single_rank_world, tmp_path):
    args = run_args(tmp_path)
    root = tmp_path / "checkpoints"
    # an interrupted first save: only the partial folder exists
    (root / "global_step1.partial").mkdir(parents=True)
    (root / "global_step1.partial" / "mp_rank_00_model_states.pt").write_bytes(b"cut off")
    plan = plan_load(args, 1)
    assert plan.mode is LoadMode.FIRST_RUN
    assert "skipped global_step1.partial" in plan.describe()

    engine = save_steps(args, [1])
    (root / "global_step2.partial").mkdir()  # a later save interrupted
    plan = plan_load(args, 1)
    assert plan.mode is LoadMode.RESUME and plan.tag == "global_step1"
    assert any("skipped global_step2.partial" in note for note in plan.notes)
    save_steps(args, [2], engine)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["global_step1", "global_step2"]


def test_legacy_incomplete_tag_without_latest_starts_from_scratch(single_rank_world, tmp_path):
    """A first save interrupted by an older version: global_step1 with configs only and no `latest`."""
    args = run_args(tmp_path)
    (tmp_path / "checkpoints" / "global_step1" / "configs").mkdir(parents=True)
    plan = plan_load(args, 1)
    assert plan.mode is LoadMode.FIRST_RUN
    assert "skipped global_step1: incomplete" in plan.describe()


def test_pruning_after_a_rollback_keeps_the_loaded_tag_and_reports_later_ones(single_rank_world, tmp_path):
    root = tmp_path / "checkpoints"
    save_steps(run_args(tmp_path), [1, 2, 3, 4])
    assert (root / "latest").read_text() == "global_step4"

    rolled_back = run_args(tmp_path, iteration=2, keep_last_n_checkpoints=2)
    engine = build_engine(rolled_back, seed=1)
    outcome = load_checkpoint(engine, plan_load(rolled_back, 1))
    assert outcome.tag == "global_step2"
    save_steps(rolled_back, [3], engine, outcome.lineage)  # replaces the old global_step3
    assert list(p.name for p in sorted(root.iterdir()) if p.is_dir()) == ["global_step2", "global_step3",
                                                                          "global_step4"]
    assert (root / "latest").read_text() == "global_step3"
    save_steps(rolled_back, [4, 5], engine, outcome.lineage)
    # 3 is older than the two newest of this run's lineage; 2 is the tag it loaded
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["global_step2", "global_step4",
                                                                    "global_step5"]
    # the tag that replaced global_step3 was this run's: its weights are the resumed engine's
    resumed = run_args(tmp_path, iteration=5, finetune=True)
    assert load_checkpoint(build_engine(resumed), plan_load(resumed, 1)).tag == "global_step5"


def test_save_dir_checks_before_the_first_step(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match=r"`save: .*file` is a file, not a directory"):
        commit.check_room_and_access(a_file)
    with pytest.raises(CheckpointError, match=r"cannot be created \(Not a directory\)"):
        commit.check_room_and_access(a_file / "below")
    commit.check_room_and_access(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())


def _run_in_small_filesystem(script: str, size: str, directory: Path) -> subprocess.CompletedProcess:
    """Run python `script` with a fresh tmpfs of `size` mounted at `directory`, in a private mount
    namespace (no root needed where user namespaces are allowed): a real filesystem that fills up."""
    directory.mkdir(parents=True, exist_ok=True)
    command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
               f'mount -t tmpfs -o size={size} tmpfs "{directory}" && exec "{sys.executable}" -c "$0"', script]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    except FileNotFoundError:
        pytest.skip("unshare is not installed")


def test_too_little_room_for_one_more_tag_is_refused_before_training(tmp_path):
    small = tmp_path / "small"
    script = f"""
import os
from megatron.checkpointing import CheckpointError
from megatron.checkpointing.saving import commit
os.makedirs("{small}/global_step1")
with open("{small}/global_step1/mp_rank_00_model_states.pt", "wb") as f:
    f.write(b"x" * (700 * 1024))
try:
    commit.check_room_and_access("{small}")
except CheckpointError as err:
    print("REFUSED", err)
"""
    result = _run_in_small_filesystem(script, "1m", small)
    if "mount" in result.stderr and result.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert f"REFUSED `save: {small}` has" in result.stdout
    assert "needs about 700.0 KiB (the size of global_step1)" in result.stdout
