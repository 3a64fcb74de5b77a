"""Holes a hostile user found in the checkpoint guarantees, each closed: files the manifest does not list, a
manifest without entries, `latest` naming an unfinished save, load plans that miss files the load reads, and
saved files whose permissions differ from a plain file's.

Real DeepSpeed engines and real files on disk; the damage is real bytes overwritten inside a saved file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from megatron.checkpointing import CheckpointError, load_checkpoint, plan_load
from megatron.checkpointing.ondisk import manifest
from megatron.fsio import write_text_atomically
from tests.ckpt_engines import build_engine
from tests.distributed.test_ckpt_save_integrity import (
    one_line,
    overwrite_inside_largest_tensor,
    run_args,
    save_steps,
)

OPTIMIZER_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL_FILE = "mp_rank_00_model_states.pt"


def saved_tag(tmp_path, steps=(1,), **settings) -> tuple[object, Path]:
    args = run_args(tmp_path, **settings)
    save_steps(args, list(steps))
    return args, tmp_path / "checkpoints" / f"global_step{steps[-1]}"


def rewrite_manifest(tag_dir: Path, edit) -> None:
    stored = json.loads((tag_dir / "manifest.json").read_text())
    edit(stored["files"])
    (tag_dir / "manifest.json").write_text(json.dumps(stored))


def test_a_damaged_optimizer_file_the_manifest_does_not_list_is_refused_before_any_engine(single_rank_world,
                                                                                          tmp_path):
    args, tag_dir = saved_tag(tmp_path)
    rewrite_manifest(tag_dir, lambda files: files.pop(OPTIMIZER_FILE))
    overwrite_inside_largest_tensor(tag_dir / OPTIMIZER_FILE, fill=b"\x7f")
    with pytest.raises(CheckpointError, match="does not list") as raised:
        plan_load(args, 1)
    assert OPTIMIZER_FILE in one_line(raised) and "delete the manifest" in one_line(raised)


def test_check_file_refuses_a_file_the_manifest_does_not_list(single_rank_world, tmp_path):
    _, tag_dir = saved_tag(tmp_path)
    records = manifest.read_manifest(tag_dir)
    assert manifest.check_file(tag_dir / MODEL_FILE, records, tag_dir) is None
    records.pop(MODEL_FILE)
    problem = manifest.check_file(tag_dir / MODEL_FILE, records, tag_dir)
    assert problem and f"does not list checkpoint file {tag_dir / MODEL_FILE}" in problem
    assert "cannot be checked" in manifest.check_file(tag_dir / MODEL_FILE, {}, tag_dir)
    assert manifest.check_file(tag_dir / MODEL_FILE, None, tag_dir) is None  # no manifest: unchecked, as said


@pytest.mark.parametrize("finetune", [True, False], ids=["module-only", "resume"])
def test_a_manifest_without_entries_is_refused_and_the_damaged_model_file_never_loads(single_rank_world, tmp_path,
                                                                                    finetune):
    args, tag_dir = saved_tag(tmp_path, finetune=finetune)
    overwrite_inside_largest_tensor(tag_dir / MODEL_FILE)
    rewrite_manifest(tag_dir, dict.clear)
    with pytest.raises(CheckpointError, match="lists no files") as raised:
        plan_load(args, 1)
    assert str(tag_dir / "manifest.json") in one_line(raised)


def test_a_tag_holding_a_file_its_manifest_does_not_list_is_refused_naming_it(single_rank_world, tmp_path):
    args, tag_dir = saved_tag(tmp_path, finetune=True)
    (tag_dir / "configs" / "extra.yml").write_text("train_iters: 5\n")
    with pytest.raises(CheckpointError) as raised:
        plan_load(args, 1)
    assert "does not list configs/extra.yml, which global_step1 holds" in one_line(raised)
    (tag_dir / "configs" / "extra.yml").unlink()
    assert any("it lists every file of the tag" in note for note in plan_load(args, 1).notes)


def test_latest_naming_an_unfinished_save_is_refused_naming_the_newest_complete_tag(single_rank_world, tmp_path):
    args, tag_dir = saved_tag(tmp_path, steps=(1, 2))
    root = tag_dir.parent
    tag_dir.rename(root / "global_step2.partial")
    (root / "latest").write_text("global_step2.partial")
    with pytest.raises(CheckpointError) as raised:
        plan_load(args, 1)
    line = one_line(raised)
    assert "names 'global_step2.partial'" in line and "never loaded" in line
    assert "Write 'global_step1' (the newest complete tag) into it, or set `iteration: 1`" in line


_opened: list[str] | None = None


def _record_opens(event: str, arguments: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(arguments[0], (str, os.PathLike)):
        _opened.append(os.fspath(arguments[0]))


sys.addaudithook(_record_opens)  # Python's own file-open audit event: every torch.load of a path raises it


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (0, "bf16"), (1, "bf16"), (2, "fp32"), (3, "fp32")])
def test_a_resumes_plan_names_exactly_the_files_its_load_opens(single_rank_world, tmp_path, stage, precision):
    """Without a manifest nothing is checksummed, so the files opened are the ones read: planning and
    DeepSpeed's load together open exactly plan.files, the list _verify_files checks when there is a manifest."""
    global _opened
    args, tag_dir = saved_tag(tmp_path, stage=stage, precision=precision)
    (tag_dir / "manifest.json").unlink()
    engine = build_engine(args, seed=1)
    _opened = []
    try:
        plan = plan_load(args, 1)
        load_checkpoint(engine, plan)
        opened = {Path(name) for name in _opened if Path(name).parent == tag_dir}
    finally:
        _opened = None
    assert plan.load_optimizer
    assert opened == set(plan.files), sorted(p.name for p in opened ^ set(plan.files))


def _plain_modes(directory: Path) -> tuple[int, int]:
    """The permissions this process's umask gives a plain new file and a new directory."""
    (directory / "plain").write_text("")
    (directory / "plain_dir").mkdir()
    return (directory / "plain").stat().st_mode & 0o777, (directory / "plain_dir").stat().st_mode & 0o777


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def test_an_atomic_write_gets_a_plain_files_permissions(tmp_path, umask):
    write_text_atomically(tmp_path / "latest", "global_step1")
    assert (tmp_path / "latest").stat().st_mode & 0o777 == _plain_modes(tmp_path)[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_every_file_and_folder_a_save_writes_has_the_umasks_permissions(single_rank_world, tmp_path, umask, stage):
    _, tag_dir = saved_tag(tmp_path, stage=stage)
    file_mode, dir_mode = _plain_modes(tmp_path)
    root = tag_dir.parent
    modes = {path.relative_to(root).as_posix(): path.stat().st_mode & 0o777 for path in root.rglob("*")}
    assert {"latest", "global_step1/manifest.json", f"global_step1/{MODEL_FILE}"} <= set(modes)
    # DeepSpeed copies its recovery scripts (zero_to_fp32.py) with the owner's execute bit added
    expected = {name: dir_mode if (root / name).is_dir() else file_mode | (0o100 if name.endswith(".py") else 0)
                for name in modes}
    wrong = {name: oct(mode) for name, mode in modes.items() if mode != expected[name]}
    assert not wrong, f"plain file {oct(file_mode)}, folder {oct(dir_mode)}; differ: {wrong}"


def test_a_manifest_rewritten_in_place_after_a_read_is_read_again(single_rank_world, tmp_path):
    """The manifest is parsed once per state of its file (every check of a tag's files asks for it): an edit
    to the same file, even one of the same size, is what the next read returns, and damage is refused."""
    _, tag_dir = saved_tag(tmp_path)
    before = manifest.read_manifest(tag_dir)[MODEL_FILE]
    flipped = "0" if before.digest[0] != "0" else "1"
    rewrite_manifest(tag_dir, lambda files: files[MODEL_FILE].update(
        {before.checksum: flipped + before.digest[1:]}))
    assert manifest.read_manifest(tag_dir)[MODEL_FILE].digest == flipped + before.digest[1:]
    assert manifest.check_file(tag_dir / MODEL_FILE, manifest.read_manifest(tag_dir), tag_dir)
    (tag_dir / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match="is damaged"):
        manifest.read_manifest(tag_dir)
