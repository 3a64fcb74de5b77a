"""A real 2-node x 1-rank job on this machine: two `python deepy.py` runs, each starting its own node's
rank as DeepSpeed's per-node launcher would (`node_rank`: --no_ssh --node_rank), with one hostfile naming two host
names that resolve here. It trains, both nodes are stopped by SIGTERM (every rank saves into the one save
directory, each node exits 0, no process is left), it resumes, and it fine-tunes.
"""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from tests.deepy_runs import train_lines, write_overrides
from tests.e2e.test_signals import RUN_SETTINGS, STOPPED_LINE, DeepyRun

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

NODES = 2
# No warmup: the few steps before the signal move the weights far enough from the init to tell a fine-tune
# that loaded them from one that did not.
TRAIN_SETTINGS = {**RUN_SETTINGS, "warmup": 0.0}


@pytest.fixture
def hostfile(tmp_path) -> Path:
    """Two host names of this machine, one rank each."""
    names = ["localhost", socket.gethostname() if socket.gethostname() != "localhost" else "127.0.0.1"]
    for name in names:
        socket.gethostbyname(name)  # both resolve here, as a cluster's node names do
    path = tmp_path / "hostfile"
    path.write_text("".join(f"{name} slots=1\n" for name in names))
    return path


def start_nodes(tmp_path: Path, hostfile: Path, name: str, configs: list, **settings) -> list[DeepyRun]:
    """deepy.py once per node, as each node's job step would run it: the same settings but node_rank."""
    shared = write_overrides(tmp_path, name=f"{name}.yml", hostfile=str(hostfile), master_addr="127.0.0.1",
                             **settings)
    runs = []
    for node in range(NODES):
        node_config = tmp_path / f"{name}_node{node}.yml"
        node_config.write_text(f"node_rank: {node}\n")
        runs.append(DeepyRun([*configs, shared, node_config]))
    return runs


def finish_all(runs: list[DeepyRun]) -> str:
    """Node 0's output (rank 0 reports) once every node has exited 0 and left no process behind."""
    for node, run in enumerate(runs):
        assert run.finish() == 0, f"node {node}:\n{run.output[-6000:]}"
        assert "Traceback" not in run.output, f"node {node}:\n{run.output[-6000:]}"
    for run in runs:
        run.assert_nothing_left()
    return runs[0].output


@pytest.mark.slow
def test_two_nodes_train_stop_on_sigterm_resume_and_finetune(tmp_path, hostfile):
    save = tmp_path / "ckpt"
    runs = start_nodes(tmp_path, hostfile, "train", ["configs/tiny.yml"], save=str(save), load=str(save),
                       **TRAIN_SETTINGS)
    runs[0].wait_for(r"model: [\d,]+ parameters per tensor-parallel rank, .* 2 data-parallel rank")
    first = runs[0].wait_for(r"iteration\s+1/2000")
    runs[0].wait_for(r"iteration\s+3/2000")
    for run in runs:  # each node's scheduler signals its own deepy.py
        run.process.send_signal(signal.SIGTERM)
    output = finish_all(runs)
    stopped = STOPPED_LINE.search(output)
    assert stopped, output[-6000:]
    iteration = int(stopped[2])
    tag_dir = save / f"global_step{iteration}"
    assert Path(stopped[3]) == tag_dir and (save / "latest").read_text().strip() == tag_dir.name
    for rank in range(NODES):  # node 1's rank saved its part into the same directory
        assert (tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").is_file(), sorted(tag_dir.iterdir())
    assert not list(save.glob("*.partial"))

    resumed = start_nodes(tmp_path, hostfile, "resume", ["configs/tiny.yml"], save=str(save), load=str(save),
                          **{**TRAIN_SETTINGS, "train_iters": iteration + 2})
    assert train_lines(finish_all(resumed))[0].iteration == iteration + 1
    assert (save / "latest").read_text().strip() == f"global_step{iteration + 2}"

    # Module-only load into bf16 ZeRO-2 on both nodes: from sample 0 again, so its first batch is the
    # one the random init saw at iteration 1; the trained weights must do better on it.
    finetuned = tmp_path / "finetuned"
    runs = start_nodes(tmp_path, hostfile, "tune", ["configs/finetune.yml"], load=str(save),
                       save=str(finetuned), train_iters=2, checkpoint_factor=2, eval_interval=1000,
                       train_micro_batch_size_per_gpu=RUN_SETTINGS["train_micro_batch_size_per_gpu"])
    lines = train_lines(finish_all(runs))
    init_loss = train_lines(first)[0].loss
    assert lines[0].iteration == 1 and lines[0].loss < init_loss - 0.3, (init_loss, lines)
    assert (finetuned / "latest").read_text().strip() == "global_step2"
    for rank in range(NODES):
        assert list((finetuned / "global_step2").glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")), rank
