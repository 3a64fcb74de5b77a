"""One run per save directory: the lock file's rules with real processes, and two real runs of deepy.py (one test,
whose first run also takes over a lock left behind by a killed process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.saving import save_lock
from megatron.processes import process_start_time
from tests.deepy_runs import REPO_ROOT, TRAIN_LINE, run_deepy, write_overrides

# A process that takes the lock of argv[1], says so, then does what argv[2] says.
HOLDER = """
import os, signal, sys
from megatron.checkpointing.saving import save_lock
save_lock.acquire(sys.argv[1], ["tiny.yml"], notice=print)
print("HELD", flush=True)
if sys.argv[2] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()  # until the test closes stdin; then exits normally
"""

CONTENDER = """
import sys
from megatron.checkpointing import CheckpointError
from megatron.checkpointing.saving import save_lock
try:
    save_lock.acquire(sys.argv[1], [], notice=print)
except CheckpointError as err:
    sys.exit(str(err))
print("ACQUIRED")
"""


def start_holder(save_dir: Path, then: str) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(save_dir), then], cwd=REPO_ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "HELD"
    return holder


def contend(save_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CONTENDER, str(save_dir)], cwd=REPO_ROOT, text=True,
                          capture_output=True, timeout=120)


def write_lock(save_dir: Path, holder: save_lock.LockHolder) -> Path:
    path = save_dir / layout.LOCK_FILE
    path.write_text(json.dumps(asdict(holder)))
    return path


def acquire_here(save_dir: Path) -> list[str]:
    """Take the lock in this process, then give it back; the notices it printed."""
    notices = []
    try:
        save_lock.acquire(save_dir, ["tiny.yml"], notice=notices.append)
        assert save_lock.LockHolder(**json.loads((save_dir / layout.LOCK_FILE).read_text())).pid == os.getpid()
    finally:
        save_lock.release_all()
    assert not (save_dir / layout.LOCK_FILE).exists()
    return notices


def test_a_second_process_is_refused_naming_the_first_until_it_ends(tmp_path):
    holder = start_holder(tmp_path, "wait")
    try:
        refused = contend(tmp_path)
        assert refused.returncode == 1
        line = refused.stderr.strip()
        assert "\n" not in line
        assert f"`save: {tmp_path}` is in use by another run, pid {holder.pid} on host {socket.gethostname()}" in line
        assert "configs tiny.yml" in line and "Wait until it ends" in line
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    assert not (tmp_path / layout.LOCK_FILE).exists()  # removed when its process ended
    assert contend(tmp_path).stdout.strip() == "ACQUIRED"


def test_the_lock_of_a_killed_run_is_taken_over_with_a_notice(tmp_path):
    holder = start_holder(tmp_path, "sigkill")
    assert holder.wait(timeout=60) == -signal.SIGKILL
    assert (tmp_path / layout.LOCK_FILE).exists()  # a SIGKILL leaves it behind
    [notice] = acquire_here(tmp_path)
    assert f"from pid {holder.pid} on host {socket.gethostname()}" in notice
    assert f"pid {holder.pid} is no longer running" in notice


def test_a_pid_that_another_process_has_now_is_stale_the_same_process_is_not(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        real = replace(save_lock.LockHolder.this_process(["tiny.yml"]), pid=sleeper.pid,
                       start_time=process_start_time(sleeper.pid))
        write_lock(tmp_path, real)
        with pytest.raises(CheckpointError, match=f"in use by another run, pid {sleeper.pid} on host"):
            acquire_here(tmp_path)
        write_lock(tmp_path, replace(real, start_time=real.start_time - 1))  # the run that had this pid before
        [notice] = acquire_here(tmp_path)
        assert f"pid {sleeper.pid} is another process now" in notice
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_of_another_host_is_refused_saying_how_to_remove_it(tmp_path):
    path = write_lock(tmp_path, replace(save_lock.LockHolder.this_process([]), host="node-17.elsewhere", pid=4242))
    with pytest.raises(CheckpointError) as raised:
        acquire_here(tmp_path)
    line = str(raised.value)
    assert "pid 4242 on host node-17.elsewhere" in line and f"if it is really gone, delete {path}" in line
    assert path.exists()


def test_a_damaged_lock_file_is_refused_in_one_line(tmp_path):
    (tmp_path / layout.LOCK_FILE).write_text("{")
    with pytest.raises(CheckpointError, match="is damaged") as raised:
        acquire_here(tmp_path)
    assert "\n" not in str(raised.value) and "delete it" in str(raised.value)


def test_a_dry_run_takes_no_lock(tmp_path, capsys):
    import deepy

    save = tmp_path / "ckpt"
    save.mkdir()
    path = write_lock(save, replace(save_lock.LockHolder.this_process([]), host="node-17.elsewhere", pid=4242))
    before = path.read_text()
    overrides = write_overrides(tmp_path, save=str(save))
    assert deepy.main(["train.py", "configs/tiny.yml", str(overrides), "--dry-run"]) == 0
    assert path.read_text() == before and sorted(p.name for p in save.iterdir()) == [layout.LOCK_FILE]


def wait_for(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.slow
def test_two_real_runs_into_one_save_directory(tmp_path):
    """A run takes over the lock a process killed with SIGKILL left behind and trains; a second run (2 ranks) into
    its directory stops with one line naming it before any step; once the first is killed with SIGKILL, its lock
    is left behind. (A real run taking over the lock of a killed real run, then removing it at its end:
    tests/e2e/test_save_failures.py, whose runs resume after a SIGKILL of the saving rank.)"""
    save = tmp_path / "ckpt"
    save.mkdir()
    killed = start_holder(save, "sigkill")
    assert killed.wait(timeout=60) == -signal.SIGKILL
    log = tmp_path / "first.log"
    first_config = write_overrides(tmp_path, "first.yml", save=str(save), train_iters=100000, checkpoint_factor=100000,
                                   eval_interval=100000)
    with open(log, "w") as out:
        first = subprocess.Popen([sys.executable, "deepy.py", "train.py", "configs/tiny.yml", str(first_config)],
                                 cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        took_over = f"took over {save.resolve() / layout.LOCK_FILE} from pid {killed.pid}"
        wait_for(lambda: took_over in log.read_text() or first.poll() is not None, "the first run's lock")
        assert first.poll() is None, log.read_text()
        holder = json.loads((save / layout.LOCK_FILE).read_text())
        assert holder["pid"] != killed.pid

        second_config = write_overrides(tmp_path, "second.yml", save=str(save), train_iters=2, num_gpus=2)
        second = run_deepy(["configs/tiny.yml", second_config], expect_success=False)
        assert second.returncode != 0
        refusals = [line for line in (second.stdout + second.stderr).splitlines() if "is in use by another run" in line]
        assert len(refusals) == 1, second.stdout + second.stderr
        assert f"pid {holder['pid']} on host {holder['host']}" in refusals[0] and "first.yml" in refusals[0]
        assert "Traceback" not in second.stderr
        assert not layout.list_tags(save)
        wait_for(lambda: train_lines_so_far(log) or first.poll() is not None, "the first run's first step")
        assert first.poll() is None, log.read_text()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    assert json.loads((save / layout.LOCK_FILE).read_text()) == holder  # a SIGKILL leaves it behind


def train_lines_so_far(log: Path) -> bool:
    return TRAIN_LINE.search(log.read_text()) is not None
