"""SIGTERM/SIGINT to a real `python deepy.py train.py ...`: a checkpoint and exit 0, or a stop at once.

The signal goes to deepy.py alone (as a scheduler or Ctrl-C sends it); deepy.py passes it on.
Every process of a run carries a marker in its environment, so the tests can tell that none is
left behind.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from megatron.stop_signals import HOLD_BEFORE_SAVE_ENV
from tests.e2e import REPO_ROOT, train_lines, write_overrides

pytestmark = pytest.mark.e2e

RUN_MARKER = "NEOX_TEST_SIGNAL_RUN"
STOPPED_LINE = re.compile(r"stopped by (SIG\w+) at iteration (\d+); checkpoint saved to (\S+)")


def processes_with_marker(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"{RUN_MARKER}={marker}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


class DeepyRun:
    """`python deepy.py train.py CONFIGS` in the background, its output read line by line."""

    def __init__(self, configs: list, extra_env: dict[str, str] | None = None):
        self.marker = uuid.uuid4().hex
        env = {**os.environ, "PYTHONUNBUFFERED": "1", RUN_MARKER: self.marker, **(extra_env or {})}
        self.process = subprocess.Popen(
            [sys.executable, "deepy.py", "train.py", *map(str, configs)], cwd=REPO_ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if re.search(pattern, line):
                return line
        self.process.kill()
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.output[-6000:]}")

    def finish(self, timeout: float = 600) -> int:
        returncode = self.process.wait(timeout=timeout)
        while (line := self._queue.get(timeout=60)) is not None:
            self.lines.append(line)
        return returncode

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 10
        while processes_with_marker(self.marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_with_marker(self.marker) == [], "processes of the run outlived deepy.py"


# Long enough never to end before the signal; the resume keeps the LR schedule (lr_decay_iters).
RUN_SETTINGS = dict(train_iters=2000, lr_decay_iters=2000, checkpoint_factor=1000, eval_interval=1000,
                    train_micro_batch_size_per_gpu=2)


def stop_config(tmp_path: Path, save: Path, **settings) -> Path:
    return write_overrides(tmp_path, name="stop.yml", save=str(save), load=str(save), **{**RUN_SETTINGS, **settings})


def assert_graceful_stop(run: DeepyRun, save: Path, signum: int, ranks: int) -> int:
    assert run.finish() == 0, run.output[-6000:]
    stopped = [STOPPED_LINE.search(line) for line in run.lines if STOPPED_LINE.search(line)]
    assert len(stopped) == 1, run.output[-6000:]
    name, iteration, tag_dir = stopped[0].groups()
    iteration = int(iteration)
    assert name == signal.Signals(signum).name
    assert Path(tag_dir) == save / f"global_step{iteration}"
    assert (save / "latest").read_text().strip() == f"global_step{iteration}"
    for rank in range(ranks):
        assert list(Path(tag_dir).glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")), rank
    assert "Traceback" not in run.output and "KeyboardInterrupt" not in run.output
    run.assert_nothing_left()
    return iteration


def assert_resumes_from(tmp_path: Path, save: Path, iteration: int) -> None:
    config = write_overrides(tmp_path, name="resume.yml", save=str(save), load=str(save),
                             **{**RUN_SETTINGS, "train_iters": iteration + 2})
    run = DeepyRun(["configs/tiny.yml", config])
    assert run.finish() == 0, run.output[-6000:]
    assert train_lines(run.output)[0].iteration == iteration + 1
    assert (save / "latest").read_text().strip() == f"global_step{iteration + 2}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_one_rank_stops_with_a_checkpoint_and_the_next_run_resumes_from_it(tmp_path, signum):
    save = tmp_path / "ckpt"
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save)])
    run.wait_for(r"iteration\s+3/2000")
    run.process.send_signal(signum)
    iteration = assert_graceful_stop(run, save, signum, ranks=1)
    assert iteration >= 3
    if signum == signal.SIGTERM:
        assert_resumes_from(tmp_path, save, iteration)


@pytest.mark.distributed
def test_two_ranks_agree_on_the_step_to_stop_at_and_both_save(tmp_path):
    save = tmp_path / "ckpt"
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save, num_gpus=2)])
    run.wait_for(r"iteration\s+3/2000")
    run.process.send_signal(signal.SIGTERM)
    assert_graceful_stop(run, save, signal.SIGTERM, ranks=2)


def test_a_second_signal_stops_at_once_without_a_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save)], extra_env={HOLD_BEFORE_SAVE_ENV: "600"})
    run.wait_for(r"iteration\s+3/2000")
    run.process.send_signal(signal.SIGTERM)
    run.wait_for(r"SIGTERM received")
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == 128 + signal.SIGTERM
    assert "stopped at once by a second SIGTERM" in run.output
    assert not STOPPED_LINE.search(run.output)
    assert not (save / "latest").exists() and not list(save.glob("global_step*"))
    run.assert_nothing_left()


def test_deepy_killed_outright_leaves_no_rank_behind(tmp_path):
    save = tmp_path / "ckpt"
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save)])
    run.wait_for(r"iteration\s+2/2000")
    run.process.kill()
    run.process.wait(timeout=30)
    run.assert_nothing_left()
