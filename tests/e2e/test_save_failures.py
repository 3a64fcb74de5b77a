"""End to end: training processes killed inside a save, and a disk that fills, then the same command again.

The kill is a real SIGKILL of the training process at a chosen moment of the save (the test-only
sigkill_during_save fault point of megatron/runtime/faults.py picks the moment); the full disk is a real, small tmpfs mounted in
a private mount namespace; a write that fails on one rank only is a real file-size limit (prlimit) set
on that running rank.

Runs shared, once per module: the 1-rank run killed in its first save and run again (`killed_in_first_save`),
whose global_step2 the full-disk test resumes; the 2-rank run killed between the rename of global_step4 and
`latest` (`killed_at_rename`), whose test resumes a copy of it, and from a copy of whose global_step2 the one-rank
write failure tests start. The settings a resume compares are the same (ranks, lr_decay_iters).

async_save: a kill point or the check of the room before a save sits where both modes run the same code
(commit.commit_tag, commit.start_writing on the main thread), so those tests run one mode each; a failed write
runs on the main thread in a blocking save and in the save's thread with async_save, so those run both.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron.checkpointing.ondisk import layout, manifest
from megatron.runtime import faults
from tests.deepy_runs import REPO_ROOT, run_deepy, train_lines, write_overrides

pytestmark = pytest.mark.e2e

QUICK = dict(eval_interval=1000, eval_iters=1, checkpoint_factor=2)


def killed_run(configs, moment: str):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **faults.switched_on(sigkill_during_save=moment)}
    result = subprocess.run([sys.executable, "deepy.py", "train.py", *map(str, configs)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode != 0, f"the run was not killed:\n{result.stdout[-3000:]}"
    return result


def losses(output: str) -> dict[int, float]:
    return {line.iteration: line.loss for line in train_lines(output)}


def directories(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir())


def lock_holder_pid(save: Path) -> int:
    return json.loads((save / layout.LOCK_FILE).read_text())["pid"]


def assert_took_over_the_killed_runs_lock(output: str, save: Path, killed_pid: int) -> None:
    """The killed rank 0 left its lock; the next run takes it over with a notice and removes it at its end."""
    assert f"took over {save.resolve() / layout.LOCK_FILE} from pid {killed_pid}" in output, output[-3000:]
    assert not (save / layout.LOCK_FILE).exists()


# the LR schedule of the 1-rank run killed in its first save, and of the full disk's longer run that resumes the
# global_step2 it saved when it ran again
ONE_RANK_LR_DECAY_ITERS = 12


@pytest.fixture(scope="module")
def killed_in_first_save(tmp_path_factory):
    """A 1-rank run killed in its first save, then the same command again: what the kill left, both outputs, and
    the save directory at the end (the full-disk test copies its global_step2)."""
    directory = tmp_path_factory.mktemp("killed_in_first_save")
    save = directory / "ckpt"
    overrides = write_overrides(directory, save=str(save), load=str(save), train_iters=4,
                                lr_decay_iters=ONE_RANK_LR_DECAY_ITERS, **QUICK)
    killed = killed_run(["configs/tiny.yml", overrides], "files_written@2")
    left = SimpleNamespace(folders=directories(save), latest=(save / "latest").exists(),
                           lock_pid=lock_holder_pid(save))
    return SimpleNamespace(save=save, killed=killed, left=left, again=run_deepy(["configs/tiny.yml", overrides]))


# One mode: the kill point sits in commit.commit_tag, which a blocking save runs on the main thread and an
# asynchronous one in its thread, the same code; the SIGKILL ends the process either way. The kill of an
# asynchronous save is test_kill_between_rename_and_latest_resumes_from_latest_and_continues_the_loss_curve.
@pytest.mark.slow
def test_kill_during_the_first_save_then_the_same_command_starts_from_scratch(killed_in_first_save):
    runs = killed_in_first_save
    assert runs.left.folders == ["global_step2.partial"] and not runs.left.latest

    assert "skipped global_step2.partial" in runs.again.stdout
    resumed = losses(runs.again.stdout)
    assert min(resumed) == 1  # from scratch: nothing complete was there
    before = losses(runs.killed.stdout)
    assert {step: resumed[step] for step in before} == before  # same seed, same data: the same curve
    assert directories(runs.save) == ["global_step2", "global_step4"]
    assert (runs.save / "latest").read_text() == "global_step4"
    assert_took_over_the_killed_runs_lock(runs.again.stdout, runs.save, runs.left.lock_pid)


# the settings of the killed run and of every run that starts from a copy of its save directory
TWO_RANKS_TO_6 = dict(train_iters=6, num_gpus=2, lr_decay_iters=6, **QUICK)


@pytest.fixture(scope="module")
def killed_at_rename(tmp_path_factory):
    """A 2-rank run with async_save, killed after global_step4 was renamed into place and before `latest` moved
    to it: (its save directory, its output). Tests copy the directory before they write to it."""
    directory = tmp_path_factory.mktemp("killed_at_rename")
    save = directory / "ckpt"
    overrides = write_overrides(directory, save=str(save), load=str(save), async_save=True, **TWO_RANKS_TO_6)
    return save, killed_run(["configs/tiny.yml", overrides], "renamed@4")


def copy_of(save: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(save, copy)
    return copy


# One mode (async_save): the kill point between the rename and `latest` is in commit._publish, the same code for
# a blocking save; a kill during a blocking save is the test above.
@pytest.mark.slow
@pytest.mark.distributed
def test_kill_between_rename_and_latest_resumes_from_latest_and_continues_the_loss_curve(tmp_path,
                                                                                         killed_at_rename):
    killed_save, killed = killed_at_rename
    # global_step4 is complete on disk, but `latest` had not moved yet
    assert directories(killed_save) == ["global_step2", "global_step4"]
    assert (killed_save / "latest").read_text() == "global_step2"
    save = copy_of(killed_save, tmp_path)
    killed_pid = lock_holder_pid(save)

    overrides = write_overrides(tmp_path, save=str(save), load=str(save), async_save=True, **TWO_RANKS_TO_6)
    again = run_deepy(["configs/tiny.yml", overrides])
    resumed = losses(again.stdout)
    assert min(resumed) == 3
    before = losses(killed.stdout)
    # training goes on while an asynchronous save is written, until the save at 6 waits for it
    assert {1, 2, 3, 4} <= set(before) <= {1, 2, 3, 4, 5, 6}
    assert resumed[3] == before[3] and resumed[4] == before[4]
    assert directories(save) == ["global_step2", "global_step4", "global_step6"]
    assert (save / "latest").read_text() == "global_step6"
    assert_took_over_the_killed_runs_lock(again.stdout, save, killed_pid)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, killed_in_first_save):
    """In a private mount namespace: a first save on a 12 MiB tmpfs fails while writing, blocking and with
    async_save; on a larger one global_step2 (of the run killed in its first save, then run again: the same model
    and LR schedule) is put; then, during a run that resumes it, another process fills the disk before its save.

    The tiny disk runs both modes: an asynchronous save writes its files in the save's thread, a blocking one on the
    main thread. The filled disk runs one: the room is checked before the save's folder is made
    (commit.start_writing), on the main thread in both modes."""
    save = tmp_path / "small_disk"
    save.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    first = {mode: write_overrides(tmp_path, name=f"first_{mode}.yml", save=str(save), load=str(save), train_iters=2,
                                   async_save=mode == "async_save", **QUICK)
             for mode in ("synchronous", "async_save")}
    # long enough that the ranks are stopped while the disk fills well before the save at its end, however late
    # this script sees iteration 3 on a busy machine (12 iterations, 0.7 s after it, were once too few)
    longer = write_overrides(tmp_path, name="longer.yml", save=str(save), load=str(save), train_iters=100,
                             lr_decay_iters=ONE_RANK_LR_DECAY_ITERS, checkpoint_factor=1000, eval_interval=1000, eval_iters=1)
    deepy = f"{shlex.quote(sys.executable)} deepy.py train.py configs/tiny.yml"
    verify = (f"{shlex.quote(sys.executable)} -c \"from megatron.checkpointing.ondisk import manifest; "
              f"from pathlib import Path; t = Path('{save}/global_step2'); "
              f"manifest.verify_files(t, [t / n for n in manifest.tag_file_names(t)]); print('INTACT')\"")
    tiny_disk = "".join(f"""
{deepy} {config} > {logs}/tiny_disk_{mode}.log 2>&1; echo "exit $?" >> {logs}/tiny_disk_{mode}.log
ls -a {save} > {logs}/after_tiny_disk_{mode}.txt""" for mode, config in first.items())
    script = f"""
set -u
mount -t tmpfs -o size=12m tmpfs {save} || exit 77
{tiny_disk}
mount -o remount,size=100m {save}
cp -r {killed_in_first_save.save / "global_step2"} {save}/ && printf global_step2 > {save}/latest || exit 1
{deepy} {longer} > {logs}/filled.log 2>&1 &
run=$!
until grep -q "iteration *3/" {logs}/filled.log; do sleep 0.05; kill -0 $run 2>/dev/null || break; done
# the ranks' process group (deepy.py starts them in their own) holds them: stopped while the disk fills,
# so that the disk is full before the save at 12 however slow this machine is
groups=$(pgrep -P $run)
for group in $groups; do pkill -STOP -g $group; done
dd if=/dev/zero of={save}/filler bs=1M count=200 2>/dev/null
for group in $groups; do pkill -CONT -g $group; done
wait $run; echo "exit $?" >> {logs}/filled.log
rm {save}/filler
cat {save}/latest > {logs}/latest.txt; ls -a {save} > {logs}/after_filled.txt
{verify} > {logs}/verify.txt 2>&1
"""
    try:
        result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", script],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    except FileNotFoundError:
        pytest.skip("unshare is not installed")
    if result.returncode == 77 or "unshare:" in result.stderr:
        pytest.skip(f"cannot mount a small filesystem here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr

    for mode in first:
        tiny = (logs / f"tiny_disk_{mode}.log").read_text()
        assert f"no space left in {save} while saving global_step2: it needs more than" in tiny, (mode, tiny[-3000:])
        assert "no earlier checkpoint was there" in tiny and "exit 0" not in tiny, mode
        # the partial tag was removed
        assert (logs / f"after_tiny_disk_{mode}.txt").read_text().split() == [".", ".."], mode

    filled = (logs / "filled.log").read_text()
    assert f"`save: {save}` has" in filled and "needs about" in filled and "(the size of global_step2)" in filled, \
        filled[-3000:]
    assert "exit 0" not in filled
    assert (logs / "latest.txt").read_text() == "global_step2"
    assert "global_step100.partial" not in (logs / "after_filled.txt").read_text()
    assert "INTACT" in (logs / "verify.txt").read_text()


def _descendant_rank_pids(parent: int) -> dict[int, int]:
    """{RANK: pid} of the training processes below process `parent`."""
    parents, ranks = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = next((item[5:] for item in environ if item.startswith(b"RANK=")), None)
        if rank is not None and b"train.py" in (entry / "cmdline").read_bytes():
            ranks[int(entry.name)] = int(rank)
    found = {}
    for pid, rank in ranks.items():
        ancestor = pid
        while ancestor in parents and ancestor != parent:
            ancestor = parents[ancestor]
        if ancestor == parent:
            found[rank] = pid
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("async_save", [False, True], ids=["synchronous", "async_save"])
def test_a_write_that_fails_on_one_rank_only_stops_every_rank_in_one_line(tmp_path, killed_at_rename, async_save):
    """Rank 1 alone gets a real 1 MiB file-size limit while it starts, so at the save of step 4 its
    optimizer shard (about 11 MiB) cannot be written while rank 0's files can: the run must stop on both
    ranks with one line, keep global_step2 and `latest`, and leave no rank behind.

    It resumes the global_step2 of the killed run (`latest` names it): its later tag and its lock are removed."""
    if subprocess.run(["prlimit", "--version"], capture_output=True).returncode != 0:
        pytest.skip("prlimit is not installed")
    save = copy_of(killed_at_rename[0], tmp_path)
    shutil.rmtree(save / "global_step4")
    (save / layout.LOCK_FILE).unlink()
    assert directories(save) == ["global_step2"] and (save / "latest").read_text() == "global_step2"
    longer = write_overrides(tmp_path, name="longer.yml", save=str(save), load=str(save), async_save=async_save,
                             **TWO_RANKS_TO_6)
    log = tmp_path / "longer.log"
    with open(log, "w") as out:
        run = subprocess.Popen([sys.executable, "deepy.py", "train.py", "configs/tiny.yml", str(longer)],
                               cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        ranks = {}
        while 1 not in ranks and run.poll() is None:
            ranks = _descendant_rank_pids(run.pid)
            time.sleep(0.05)
        assert 1 in ranks, log.read_text()[-3000:]
        subprocess.run(["prlimit", f"--pid={ranks[1]}", f"--fsize={1 << 20}"], check=True)
        run.wait(timeout=600)  # a rank left waiting for another would hang here
    finally:
        run.kill()
    output = log.read_text()
    assert run.returncode != 0
    shard = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    errors = [line for line in output.splitlines() if line.startswith("error")]
    assert len(errors) == 1, output[-4000:]
    assert errors[0].startswith(
        f"error: rank 1: cannot write {shard} of global_step4 in {save}: this process may write files of at most "
        "1.0 MiB (its file-size limit, `ulimit -f`), the checkpoint needs about "), errors[0]
    assert "(the size of global_step2)" in errors[0]
    assert f"The run stopped; {save / 'global_step2'} is intact." in errors[0]
    assert "Traceback" not in output
    assert not any(_alive(pid) for pid in ranks.values())
    assert directories(save) == ["global_step2"]
    assert (save / "latest").read_text() == "global_step2"
    tag = save / "global_step2"
    manifest.verify_files(tag, [tag / name for name in manifest.tag_file_names(tag)])
