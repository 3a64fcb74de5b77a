"""A checkpoint file is checked against its manifest once per node: sibling processes of one launch (here:
children of this pytest process, as ranks are children of DeepSpeed's launcher) reuse the first check,
and a file changed after it is checked again.

Each child reads the file through load_checkpoint_file and counts the checksum passes it ran (the real
manifest.check_open_file, wrapped to count its calls).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from megatron.checkpointing.ondisk import layout, manifest
from megatron.processes import process_start_time

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
from contextlib import nullcontext
from pathlib import Path
from megatron.checkpointing.ondisk import manifest
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk.module_weights import load_checkpoint_file
from megatron.checkpointing.ondisk.verified_files import checks_beside_use

checks = []
check_open_file = manifest.check_open_file
def counted(*args, **kwargs):
    checks.append(1)
    return check_open_file(*args, **kwargs)
manifest.check_open_file = counted
try:
    with checks_beside_use() if sys.argv[2] == "beside" else nullcontext():
        total = float(load_checkpoint_file(Path(sys.argv[1]))["module"]["w"].double().sum())
    print(json.dumps({"checks": len(checks), "sum": total}))
except CheckpointError as err:
    print(json.dumps({"checks": len(checks), "error": str(err)}))
"""


def _child(path: Path, when: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), when], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def tag_file(tmp_path):
    tag_dir = tmp_path / "global_step1"
    tag_dir.mkdir()
    path = tag_dir / layout.model_states_name(0)
    weights = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    torch.save({"module": {"w": weights}}, path)
    manifest.write_manifest(tag_dir, {path.name: manifest.record_file(path)})
    return path, float(weights.double().sum())


@pytest.mark.slow  # three fresh interpreters importing torch: ~10 s idle, ~30 s on this shared machine
@pytest.mark.parametrize("when", ["before", "beside"], ids=["checked-before-the-read", "checked-beside-the-read"])
def test_a_sibling_reuses_the_check_and_a_changed_file_is_checked_again(tag_file, when):
    """`beside`: as a run's load reads, inside checks_beside_use(), whose thread checks the file."""
    path, expected_sum = tag_file
    size = path.stat().st_size

    first = _child(path, when)
    assert first["sum"] == expected_sum
    assert first["checks"] == 1

    second = _child(path, when)  # a sibling of the first: same parent, same node
    assert second["sum"] == expected_sum
    assert second["checks"] == 0, "the second process checked the file again"

    # damage one byte in place (same inode, same size) inside the tensor's data
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        byte = handle.read(1)
        handle.seek(size // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    third = _child(path, when)
    assert third["checks"] == 1 and "is damaged" in third.get("error", ""), third


def test_a_launch_removes_the_marker_folders_of_launches_that_ended_and_keeps_the_others(tag_file):
    temporary, uid = Path(tempfile.gettempdir()), os.getuid()
    ended_launcher = subprocess.Popen(["true"])
    ended_launcher.wait()  # its id names no process now, or one started after the first clock tick
    live_launcher = subprocess.Popen(["sleep", "120"])
    live_start = process_start_time(live_launcher.pid)
    ended = [temporary / f"neox-checked-files-{uid}-{ended_launcher.pid}-1",
             temporary / f"neox-checked-files-{uid}-{live_launcher.pid}-{live_start + 1}"]  # the id taken again
    kept = [temporary / f"neox-checked-files-{uid}-{live_launcher.pid}-{live_start}",
            temporary / f"neox-checked-files-{uid + 1}-{ended_launcher.pid}-1"]  # another user's name
    try:
        for folder in ended + kept:
            folder.mkdir(mode=0o700)
            (folder / "marker").touch()
        assert _child(tag_file[0], "before")["checks"] == 1
        assert [folder.exists() for folder in ended + kept] == [False, False, True, True]
    finally:
        live_launcher.kill()
        live_launcher.wait()
        for folder in ended + kept:
            shutil.rmtree(folder, ignore_errors=True)
