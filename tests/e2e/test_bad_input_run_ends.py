"""A run whose rank raises inside the training loop ends, with data-loader workers running: the error is the
last thing it prints, it exits non-zero within a bound, and the checkpoint `latest` names stays whole.

Each deepy.py run here ends a different way: a bug on every rank, an expected error on one of two ranks (the
other in a collective, or busy outside one), data refused before the first step, a rank killed outright. One
rank failing alone takes the path each of two ranks takes (megatron/runtime/rank_errors.run_rank, deepy.py
printing the first rank's line), so no 1-rank run repeats a 2-rank case."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from megatron.data.indexed_dataset import data_file_path
from megatron.neox_arguments import NeoXArgs
from megatron.runtime import faults
from megatron.runtime.rank_errors import EXIT_EXPECTED_ERROR
from tests.deepy_runs import REPO_ROOT, run_deepy, write_overrides
from tests.e2e.test_bad_input import assert_one_line
from tests.e2e.test_signals import DeepyRun
from tests.unit.test_data_vocabulary import MODEL, write_dataset

pytestmark = pytest.mark.e2e

# From the moment the data turns bad to the end of deepy.py: a few more steps, the error, the exits. Without
# the fix the failed rank waited for its data-loader workers for ever.
ENDS_WITHIN_SECONDS = 60
# From the step after which one rank fails to the end of deepy.py: the failed rank's exit, deepy.py giving the
# others a few seconds to end on their own, then ending them. Without the fix a rank other than 0 kept quiet
# for 30 s before it exited.
ONE_RANK_FAILS_ENDS_WITHIN_SECONDS = 25


def _tokenizer(tmp_path) -> dict:
    from megatron.tokenizer import build_tokenizer, train_bpe_tokenizer

    vocab_file = train_bpe_tokenizer(["def f(x):\n    return x * x\n"] * 50, tmp_path / "tok.json", vocab_size=300)
    settings = {"tokenizer_type": "HFTokenizer", "vocab_file": str(vocab_file)}
    return {**settings, "vocab_size": build_tokenizer(NeoXArgs.from_dict({**MODEL, **settings})).vocab_size}


def _sft_data(tmp_path, vocab_size: int, bad_label: tuple[int, int, int] | None = None) -> tuple[str, str]:
    """A token file and its label file; `bad_label` (document, position, id) puts an id in the labels."""
    documents = [[(7 * i + j) % vocab_size for j in range(40)] for i in range(64)]
    labels = [list(document) for document in documents]
    if bad_label is not None:
        document, position, label = bad_label
        labels[document][position] = label
    tokens = write_dataset(tmp_path / "sft_document", documents)
    return tokens, write_dataset(tmp_path / "sft_label_document", labels, dtype=np.int32)


class _Lines:
    """A stream's lines, read as they come; `wait_for(pattern)` blocks until a line matches it."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, pattern: str, seconds: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: any(re.search(pattern, line) for line in self.lines), seconds)


def _ended_after_step_3(config, bound: float, what: str, extra_env: dict[str, str] | None = None,
                        at_step_3=lambda: None) -> tuple[int, _Lines]:
    """Run deepy.py train.py on configs/tiny.yml and `config`; once it printed iteration 3, call `at_step_3` and
    give the run `bound` seconds to end (a test failure naming `what` when it does not). Returns its exit status
    and its stderr lines, read to the end."""
    run = subprocess.Popen([sys.executable, "deepy.py", "train.py", "configs/tiny.yml", str(config)], cwd=REPO_ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})})
    stdout, stderr = _Lines(run.stdout), _Lines(run.stderr)
    try:
        assert stdout.wait_for(r"iteration\s+3/", 600), "\n".join(stdout.lines[-20:] + stderr.lines[-40:])
        at_step_3()
        started = time.monotonic()
        returncode = run.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {bound} s after {what}:\n" + "\n".join(stderr.lines[-30:]))
    finally:
        run.kill()  # deepy.py's watchdog then kills the ranks' process group
        run.wait()
    print(f"ended {time.monotonic() - started:.1f} s after {what}")
    time.sleep(0.5)  # the readers reach the end of both streams
    return returncode, stderr


# 2 ranks, not 1: each rank fails here as the only rank of a 1-rank run would (run_rank ends its workers and
# re-raises the bug), and deepy.py must still end with a traceback when several ranks have one
@pytest.mark.slow
def test_a_rank_that_raises_in_the_loop_with_workers_ends_the_run_with_its_error_last(tmp_path):
    """The label file is rewritten under the running run (ids past the vocabulary: the check at open passed the
    old ones); the next batch fails in the loss with IndexError while two data-loader workers run on each rank."""
    ranks = 2
    tokenizer = _tokenizer(tmp_path)
    vocab_size = tokenizer.pop("vocab_size")
    tokens, labels = _sft_data(tmp_path, vocab_size)
    save = tmp_path / "ckpt"
    config = write_overrides(tmp_path, **tokenizer, train_data_paths=[tokens], train_label_data_paths=[labels],
                             num_workers=2, num_gpus=ranks, train_iters=500, eval_interval=1000, save=str(save), checkpoint_factor=2)

    def corrupt_labels() -> None:
        label_bin = np.memmap(data_file_path(labels), dtype=np.int32, mode="r+")
        label_bin[:] = 99999
        label_bin.flush()

    returncode, stderr = _ended_after_step_3(config, ENDS_WITHIN_SECONDS, "the label file turned bad",
                                             at_step_3=corrupt_labels)
    assert returncode != 0
    last = [line for line in stderr.lines if line.strip()][-1]
    assert last.endswith("IndexError: Target 99999 is out of bounds."), "\n".join(stderr.lines[-30:])
    assert not any("stopping after this iteration" in line for line in stderr.lines)
    tag = (save / "latest").read_text().strip()
    assert (save / tag / "manifest.json").is_file()


# No 1-rank case: an expected error of the only rank takes run_rank's and deepy.py's path that the refused data
# of test_label_ids_past_the_vocabulary_are_refused_before_the_first_step_in_one_line takes (its "error: " line
# last, exit status 1), and the failure inside the loop is the fault point these 2-rank runs hit
@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "workers", "held"), [
    pytest.param(2, 2, False, id="2 ranks, workers"),
    pytest.param(2, 0, True, id="2 ranks, rank 0 busy"),
])
def test_when_one_rank_fails_the_run_ends_within_seconds_with_its_line_last(tmp_path, ranks, workers, held):
    """The last rank alone fails after step 3, as on a file only it reads; the others are in the next step or
    waiting for it in a collective, or (held) busy outside one, as in a long step or a save. Before, rank 1 kept
    quiet for 30 s, rank 0's lines ("lost the connection") came after its line, and a busy rank 0 took the SIGTERM
    that ended it for a stop request ("stopping after this iteration with a checkpoint")."""
    failing = ranks - 1
    config = write_overrides(tmp_path, num_gpus=ranks, num_workers=workers, train_iters=500, eval_interval=1000)
    faults_on = faults.switched_on(fail_after_iteration=f"{failing}@3", **({"hold_after_iteration": 3} if held else {}))
    returncode, stderr = _ended_after_step_3(config, ONE_RANK_FAILS_ENDS_WITHIN_SECONDS, f"rank {failing} failed",
                                             extra_env=faults_on)
    assert returncode == EXIT_EXPECTED_ERROR
    line = f"fault point fail_after_iteration: rank {failing} failed after iteration 3"
    printed = [text for text in stderr.lines if text.strip()]
    assert printed[-1] == (f"error on rank {failing}: " if failing else "error: ") + line, "\n".join(printed[-30:])
    assert [text for text in printed if text.startswith("error")] == printed[-1:], "\n".join(printed[-30:])
    assert not any("stopping after this iteration" in text for text in printed)


@pytest.mark.slow
def test_label_ids_past_the_vocabulary_are_refused_before_the_first_step_in_one_line(tmp_path):
    """The issue's run: before, it trained until the batch holding the label, then raised IndexError and hung."""
    tokenizer = _tokenizer(tmp_path)
    tokens, labels = _sft_data(tmp_path, tokenizer.pop("vocab_size"), bad_label=(41, 7, 99999))
    config = write_overrides(tmp_path, **tokenizer, train_data_paths=[tokens], train_label_data_paths=[labels],
                             num_workers=2, train_iters=3, eval_interval=3)
    result = run_deepy(["configs/tiny.yml", config], expect_success=False, timeout=600)
    assert result.returncode == EXIT_EXPECTED_ERROR
    line = assert_one_line(result, f"train_label_data_paths[0]: label file {labels} holds label id 99999 "
                                   "(document 41, position 7), but the model has")
    assert result.stderr.rstrip().endswith(line) and " | loss " not in result.stdout


@pytest.mark.parametrize(("error", "last_line"), [("DataError('train_data_paths[0]: a bad record')",
                                                   "error: train_data_paths[0]: a bad record"),
                                                  ("IndexError('Target 99999 is out of bounds.')",
                                                   "IndexError: Target 99999 is out of bounds.")],
                         ids=["expected error", "bug"])
def test_a_rank_ends_on_its_error_while_its_data_loader_workers_run(error, last_line):
    """A rank as train.py sets it up (stop signals blocked, also in the workers it starts), failing while two
    workers of its iterator are running: it ends at once, its one line (a bug: its traceback) last."""
    script = (
        "import sys\n"
        "from megatron.runtime.stop_signals import StopSignals\n"
        "StopSignals().install()\n"
        "from torch.utils.data import DataLoader\n"
        "from megatron.data.errors import DataError\n"
        "from megatron.runtime.rank_errors import run_rank\n"
        "def main():\n"
        "    batches = iter(DataLoader(list(range(100)), batch_size=2, num_workers=2))\n"
        "    next(batches)\n"
        f"    raise {error}\n"
        "sys.exit(run_rank(main))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=ENDS_WITHIN_SECONDS,
                            cwd=REPO_ROOT)
    assert result.returncode == 1
    assert result.stderr.rstrip().splitlines()[-1] == last_line, result.stderr[-3000:]


def test_an_expected_error_in_a_data_loader_worker_is_the_same_one_line_as_without_workers():
    """torch re-raises a worker's error in the rank with the worker's whole traceback as its message; the rank still
    reports the error's own line, spread over two lines as the error gave it (it was a traceback in one line)."""
    script = (
        "import sys\n"
        "from megatron.runtime.stop_signals import StopSignals\n"
        "StopSignals().install()\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "from megatron.data.errors import DataError\n"
        "from megatron.runtime.rank_errors import run_rank\n"
        "class Records(Dataset):\n"
        "    def __len__(self):\n"
        "        return 100\n"
        "    def __getitem__(self, index):\n"
        "        if index == 7:\n"
        "            raise DataError('train_data_paths[0]: record 7 is bad\\nfix it')\n"
        "        return index\n"
        "def main():\n"
        "    for _ in DataLoader(Records(), batch_size=2, num_workers=int(sys.argv[1])):\n"
        "        pass\n"
        "sys.exit(run_rank(main))\n")
    for workers in (0, 2):
        result = subprocess.run([sys.executable, "-c", script, str(workers)], capture_output=True, text=True,
                                timeout=ENDS_WITHIN_SECONDS, cwd=REPO_ROOT)
        assert result.returncode == EXIT_EXPECTED_ERROR
        assert result.stderr.splitlines() == ["error: train_data_paths[0]: record 7 is bad fix it"], result.stderr


@pytest.mark.slow
def test_a_rank_killed_outright_is_named_as_the_cause_in_deepys_last_line(tmp_path):
    """A rank the out-of-memory killer ends says nothing; the other rank only says it lost the connection. Its
    status tells which signal ended it: deepy.py says so last and exits as a shell does for a process killed by it."""
    config = write_overrides(tmp_path, num_gpus=2, train_iters=500, eval_interval=1000)
    run = DeepyRun(["configs/tiny.yml", config])
    run.wait_for(r"iteration\s+3/")
    os.kill(run.ranks()[1], signal.SIGKILL)
    assert run.finish(timeout=60) == 128 + signal.SIGKILL
    printed = [line.strip() for line in run.lines if line.strip()]
    assert printed[-1].startswith("deepy.py: a rank was ended by SIGKILL without a message of its own: a process "
                                  "outside this run sent it"), "\n".join(printed[-10:])
