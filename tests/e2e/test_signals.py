"""SIGTERM/SIGINT to a real `python deepy.py train.py ...`: a checkpoint and exit 0, or a stop at once.

The signal goes where a user or a scheduler sends it: deepy.py alone (Ctrl-C, `kill`), the process
group a srun-like wrapper put deepy.py in, one rank, or every process of the run at once (as Slurm or systemd signal every process of a job). Every process of a run
carries a marker in its environment, so the tests can find them and tell that none is left behind.

Each run costs a start of deepy.py and the ranks (about 20 s), so each recipient
whose signal takes a path of its own gets one run, and the recipients whose signal takes the same path
as another's share its run (the comment above the first test says which).
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

import psutil
import pytest

from megatron.launch.launcher import RankCommand
from megatron.launch.supervision import Supervisor
from megatron.runtime import faults
from megatron.runtime.stop_signals import SAME_REQUEST_SECONDS
from tests.deepy_runs import REPO_ROOT, train_lines, write_overrides

pytestmark = pytest.mark.e2e

RUN_MARKER = "NEOX_TEST_SIGNAL_RUN"
STOPPED_LINE = re.compile(r"stopped by (SIG\w+) at iteration (\d+); checkpoint saved to (\S+)")
SRUN_LIKE = REPO_ROOT / "tests" / "srun_like.py"


def processes_with_marker(marker: str) -> dict[int, str]:
    """pid -> command line of every process (but this one) whose environment carries `marker`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"{RUN_MARKER}={marker}".encode() in environ.split(b"\0"):
            found[int(entry.name)] = cmdline
    return found


class DeepyRun:
    """`python deepy.py train.py CONFIGS` in the background (under `wrapper` when given), its output
    read line by line."""

    def __init__(self, configs: list, extra_env: dict[str, str] | None = None, wrapper: tuple[str, ...] = ()):
        self.marker = uuid.uuid4().hex
        env = {**os.environ, "PYTHONUNBUFFERED": "1", RUN_MARKER: self.marker, **(extra_env or {})}
        self.process = subprocess.Popen(
            [*wrapper, sys.executable, "deepy.py", "train.py", *map(str, configs)], cwd=REPO_ROOT, env=env,
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
        self.kill_everything()
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.output[-6000:]}")

    def finish(self, timeout: float = 600) -> int:
        try:
            returncode = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_everything()
            returncode = None
        while (line := self._queue.get(timeout=60)) is not None:
            self.lines.append(line)
        if returncode is None:
            raise AssertionError(f"deepy.py still ran after {timeout} s; output:\n{self.output[-6000:]}")
        return returncode

    def kill_everything(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def processes(self, *, command_has: str = "") -> list[int]:
        return [pid for pid, cmdline in processes_with_marker(self.marker).items() if command_has in cmdline]

    def deepy(self) -> int:
        """The pid of deepy.py (run.process is the wrapper's when there is one)."""
        command = f"{sys.executable} deepy.py "
        return next(pid for pid, cmdline in processes_with_marker(self.marker).items() if cmdline.startswith(command))

    def ranks(self) -> dict[int, int]:
        """RANK -> pid of every rank of the run: the children of deepy.py started with a --local_rank (its watchdog
        is not, and a rank's data-loader workers are the rank's children)."""
        ranks = {}
        for child in psutil.Process(self.deepy()).children():
            if any(part.startswith("--local_rank=") for part in child.cmdline()):
                environ = Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0")
                ranks[int(next(entry for entry in environ if entry.startswith(b"RANK="))[5:])] = child.pid
        return ranks

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.processes() == [], "processes of the run outlived deepy.py"


def send(pids: list[int], signum: int) -> None:
    assert pids
    for pid in pids:
        os.kill(pid, signum)


def signal_the_job(run: DeepyRun, receivers: str, signum: int) -> None:
    """Send `signum` to the `receivers` of the run, as the test ids below name them."""
    if receivers == "the srun-like wrapper's group":
        run.process.send_signal(signum)  # the wrapper passes it on to its whole group
    elif receivers == "deepy.py alone":
        send([run.deepy()], signum)
    elif receivers == "the last rank":
        ranks = run.ranks()
        send([ranks[max(ranks)]], signum)
    elif receivers == "every process":
        send(run.processes(), signum)
    else:
        raise ValueError(receivers)


def assert_the_wrappers_group_holds_deepy_alone(run: DeepyRun) -> None:
    """A signal to the group is then a signal to deepy.py alone, as from `kill` (the two share a test case)."""
    deepy = psutil.Process(run.process.pid).children()[0].pid
    in_the_group = []
    for pid in run.processes():
        try:
            if os.getpgid(pid) == os.getpgid(deepy):
                in_the_group.append(pid)
        except ProcessLookupError:
            continue
    assert in_the_group == [deepy], {pid: processes_with_marker(run.marker).get(pid) for pid in in_the_group}


def assert_two_processes_deep(run: DeepyRun) -> None:
    """deepy.py -> the ranks: no runner and no per-node launcher between them (each would cost a start and an end
    of an interpreter that imports torch); deepy.py's only other child is its watchdog."""
    children = psutil.Process(run.deepy()).children()
    ranks = run.ranks()
    assert sorted(ranks) == [0, 1], [child.cmdline() for child in children]
    assert all(psutil.Process(pid).cmdline()[1:3] == ["-u", "train.py"] for pid in ranks.values())
    others = [child.cmdline()[1] for child in children if child.pid not in ranks.values()]
    assert others == ["-c"], [child.cmdline() for child in children]  # the watchdog


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
    assert not list(save.glob("*.partial")), list(save.iterdir())
    for rank in range(ranks):
        assert list(Path(tag_dir).glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")), rank
    assert "Traceback" not in run.output and "KeyboardInterrupt" not in run.output, run.output[-6000:]
    run.assert_nothing_left()
    return iteration


def assert_resumes_from(tmp_path: Path, save: Path, iteration: int, **settings) -> None:
    config = write_overrides(tmp_path, name="resume.yml", save=str(save), load=str(save),
                             **{**RUN_SETTINGS, **settings, "train_iters": iteration + 2})
    run = DeepyRun(["configs/tiny.yml", config])
    assert run.finish() == 0, run.output[-6000:]
    assert train_lines(run.output)[0].iteration == iteration + 1
    assert (save / "latest").read_text().strip() == f"global_step{iteration + 2}"


# Which recipients' signals take a path of their own (megatron/launch/supervision.py,
# megatron/runtime/stop_signals.py), and which run checks each:
# - deepy.py alone (`kill`): deepy.py passes the signal on to every rank; its handler takes a signal the same way
#   whoever sent it. So this run also checks the srun-like wrapper's group, which holds deepy.py alone (its ranks
#   and watchdog start process groups of their own; the second-SIGINT test checks that the group holds no other process
#   of the run, then signals deepy.py through it).
#   The signal is SIGINT here (Ctrl-C), SIGTERM in the other runs: every process handles both alike (STOP_SIGNALS).
# - every process: copies from the scheduler and deepy.py reach each rank within moments and count as
#   one request. With async_save, as the stop must also end only once its checkpoint is committed.
# - one rank (the last): the rank's own handler notes it and the other rank learns of it only through the
#   agreement on the step to stop at. The pipeline test below signals the last rank alone: the training loop asks
#   for that agreement at the same place with or without a pipeline (megatron/training/loop.py), and a one-rank
#   run's only rank is a last rank that needs no agreement.
# The two-rank runs cover the one-rank runs of each recipient: the same handlers, with the agreement on top.
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("receivers", "signum", "settings"), [
    ("deepy.py alone", signal.SIGINT, {}),
    ("every process", signal.SIGTERM, {"async_save": True}),
], ids=["deepy.py alone", "every process, async_save"])
def test_two_ranks_agree_on_the_step_to_stop_at_and_both_save(tmp_path, receivers, signum, settings):
    save = tmp_path / "ckpt"
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save, num_gpus=2, **settings)])
    run.wait_for(r"iteration\s+3/2000")
    assert_two_processes_deep(run)
    signal_the_job(run, receivers, signum)
    iteration = assert_graceful_stop(run, save, signum, ranks=2)
    assert iteration >= 3
    if receivers == "deepy.py alone":  # one resume is enough: the checkpoint is written alike whoever stops
        assert_resumes_from(tmp_path, save, iteration, num_gpus=2)


@pytest.mark.slow
def test_a_signal_to_every_process_while_the_rank_starts_stops_before_the_first_step(tmp_path):
    save = tmp_path / "ckpt"
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save)], extra_env=faults.switched_on(hold_before_first_step=300))
    run.wait_for(r"model: [\d,]+ parameters")  # the rank is building its engine, then waits for the signal
    signal_the_job(run, "every process", signal.SIGTERM)
    assert run.finish() == 0, run.output[-6000:]
    assert re.search(r"stopped by SIGTERM at iteration 0, before the first step of this run; nothing to save",
                     run.output), run.output[-6000:]
    assert not STOPPED_LINE.search(run.output) and "Traceback" not in run.output
    assert not save.exists() or not list(save.iterdir())
    run.assert_nothing_left()


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.MULTILINE)[1], 16)
    return bool(caught & (1 << (signum - 1)))


def test_a_signal_before_any_rank_exists_ends_deepy_with_one_line(tmp_path):
    save = tmp_path / "ckpt"
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save)])
    while not catches(run.process.pid, signal.SIGTERM):  # deepy.py has begun: it still imports and checks
        time.sleep(0.01)
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == 0, run.output[-6000:]
    assert run.output.strip().splitlines()[-1] == "deepy.py: stopped by SIGTERM before any rank started; nothing to save"
    assert "Traceback" not in run.output
    assert not save.exists()
    run.assert_nothing_left()


def test_a_signal_to_deepy_as_it_starts_the_ranks_stops_them_before_the_first_step(tmp_path):
    """deepy.py prints what it starts, then starts the ranks with the stop signals blocked: a signal right then
    waits in each rank until it can take it, and the run ends before its first step."""
    save = tmp_path / "ckpt"
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save)])
    run.wait_for(r"^deepy\.py: ranks ")
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=300) == 0, run.output[-6000:]
    assert re.search(r"stopped by SIGTERM at iteration 0, before the first step of this run; nothing to save",
                     run.output), run.output[-6000:]
    assert "Traceback" not in run.output and not STOPPED_LINE.search(run.output)
    assert not save.exists() or not list(save.iterdir())
    run.assert_nothing_left()


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "--dry-run"])
def test_a_stop_whose_exit_a_library_swallowed_still_ends_deepy_before_the_launch(tmp_path, dry_run):
    """torch's C import of numpy clears whatever error it meets: a SIGTERM whose handler runs in there loses its
    SystemExit, and deepy.py went on to start the run (1 start in 30 with the signal during the imports).
    Here the handler's exit is swallowed the same way for certain, before deepy.py runs."""
    save = tmp_path / "ckpt"
    command_line = ["deepy.py", "train.py", "configs/tiny.yml", str(stop_config(tmp_path, save, train_iters=2)),
                    *(["--dry-run"] if dry_run else [])]
    swallowing_start = (
        "import runpy, signal, sys\n"
        "from megatron.launch.supervision import stop_quietly_before_launch\n"
        "stop_quietly_before_launch()\n"
        "try:\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "except SystemExit:\n"
        "    pass\n"
        f"sys.argv = {command_line!r}\n"
        "runpy.run_path('deepy.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", swallowing_start], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert done.stderr.strip().splitlines()[-1] == \
        "deepy.py: stopped by SIGTERM before any rank started; nothing to save", output[-6000:]
    assert output.count("stopped by SIGTERM") == 1 and done.stdout == "", output[-6000:]
    assert not re.search(r"^deepy\.py: ranks ", output, re.MULTILINE) and not save.exists(), output[-6000:]


RANK_TAKING_A_SIGNAL = """import signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as a rank's stop-signal thread takes them
taken = signal.sigtimedwait({signal.SIGTERM}, 60)
print("the rank took", "nothing in 60 s" if taken is None else signal.Signals(taken.si_signo).name)
"""


def test_a_signal_taken_while_the_ranks_are_being_started_is_passed_on_once_they_exist(capfd):
    """deepy.py blocks the stop signals in its main thread while it starts the ranks, but a signal can reach
    another of its threads, and Python then runs the handler in the middle of Popen, before the ranks exist.
    Here the handler runs at that moment for certain: before run() starts a real process group."""
    supervisor = Supervisor([RankCommand([sys.executable, "-c", RANK_TAKING_A_SIGNAL], dict(os.environ))] * 2)
    supervisor._on_signal(signal.SIGTERM, None)
    assert supervisor.run() == 0
    assert capfd.readouterr().out.splitlines() == ["the rank took SIGTERM"] * 2


def test_when_a_rank_fails_the_others_are_ended_and_deepy_exits_with_its_status(capfd):
    """One rank exits 3 at once, the other would run a minute: after the grace the group is killed, the status is
    the failed rank's, and the watch over the killed rank says nothing (it found its rank reaped)."""
    failing = RankCommand([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ))
    running = RankCommand([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    supervisor = Supervisor([failing, running])
    started = time.monotonic()
    assert supervisor.run() == 3
    assert time.monotonic() - started < 40
    assert [process.returncode for process in supervisor.processes] == [3, -signal.SIGKILL]
    assert "Traceback" not in capfd.readouterr().err


# Two paths for the second request: deepy.py kills the ranks' group (Ctrl-C twice: the terminal signals the
# group, which holds deepy.py alone), or each rank ends itself by it as well (every process).
@pytest.mark.parametrize("receivers", ["the srun-like wrapper's group", "every process"])
@pytest.mark.slow
def test_a_second_sigint_stops_at_once_without_a_traceback_and_latest_unchanged(tmp_path, receivers):
    save = tmp_path / "ckpt"
    wrapper = (sys.executable, str(SRUN_LIKE)) if receivers == "the srun-like wrapper's group" else ()
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save, extra_save_iters=[2])],
                   extra_env=faults.switched_on(hold_before_stop_save=600), wrapper=wrapper)
    run.wait_for(r"iteration\s+3/2000")
    if wrapper:
        assert_the_wrappers_group_holds_deepy_alone(run)
    deadline = time.monotonic() + 120  # async_save: the save of step 2 is committed in the background
    while not (save / "latest").is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (save / "latest").read_text().strip() == "global_step2"
    signal_the_job(run, receivers, signal.SIGINT)
    run.wait_for(r"SIGINT received")
    time.sleep(SAME_REQUEST_SECONDS + 0.5)  # a later signal, not a copy of the first
    signal_the_job(run, receivers, signal.SIGINT)
    assert run.finish(timeout=120) == 128 + signal.SIGINT
    assert "stopped at once by a second SIGINT" in run.output
    assert "Traceback" not in run.output and "KeyboardInterrupt" not in run.output, run.output[-6000:]
    assert not STOPPED_LINE.search(run.output)
    assert (save / "latest").read_text().strip() == "global_step2"
    assert sorted(path.name for path in save.glob("global_step*")) == ["global_step2"]
    run.assert_nothing_left()


def test_deepy_killed_outright_leaves_no_rank_behind(tmp_path):
    save = tmp_path / "ckpt"
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save)])
    run.wait_for(r"iteration\s+2/2000")
    run.process.kill()
    run.process.wait(timeout=30)
    run.assert_nothing_left()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_pipeline_stages_stop_at_the_same_step_and_save_their_layer_files(tmp_path):
    """SIGTERM to the last stage only: both stages agree on the step, save GPT-NeoX's layer files, exit 0.
    Also the file's case of a signal that reaches one rank alone (see the comment above the first test)."""
    save = tmp_path / "ckpt"
    run = DeepyRun(["configs/tiny.yml", stop_config(tmp_path, save, num_gpus=2, pipe_parallel_size=2,
                                                     gradient_accumulation_steps=2)])
    run.wait_for(r"iteration\s+3/2000")
    signal_the_job(run, "the last rank", signal.SIGTERM)
    iteration = assert_graceful_stop(run, save, signal.SIGTERM, ranks=1)  # one data-parallel replica
    tag_dir = save / f"global_step{iteration}"
    assert (tag_dir / "layer_00-model_00-model_states.pt").is_file()
    assert (tag_dir / "layer_08-model_00-model_states.pt").is_file()  # the output layer, on the last stage
    assert list(tag_dir.glob("*zero_pp_rank_0_mp_rank_01_optim_states.pt"))  # the last stage's shard
