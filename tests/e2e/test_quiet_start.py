"""Commands as a user types them print no other library's notices unless asked; slow start-up stages say so."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.deepy_runs import REPO_ROOT, foreign_notices

DRY_RUN = ["deepy.py", "train.py", "configs/tiny.yml", "--dry-run"]
# a tool whose start imports DeepSpeed and megatron-core (the model), as the converters do
TOOL_HELP = ["tools/ckpts/convert_neox_to_hf.py", "--help"]
# megatron-core says it on import wherever Transformer Engine and Apex are missing; DeepSpeed and torch say
# theirs on a machine without a usable GPU
CORE_NOTICE = "Transformer Engine and Apex are not installed"
CPU_NOTICE = "Setting accelerator to CPU"
ON_CPU = not os.path.exists("/dev/nvidia0")


def run(command: list[str], **environment: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "NEOX_VERBOSE"}
    result = subprocess.run([sys.executable, *command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**env, "PYTHONPATH": str(REPO_ROOT), **environment})
    return result


@pytest.mark.parametrize("command", [DRY_RUN, TOOL_HELP, ["generate.py", "--help"]],
                         ids=["deepy-dry-run", "converter-help", "generate"])
@pytest.mark.slow
def test_commands_print_no_foreign_notices(command):
    result = run(command)
    assert foreign_notices(result.stdout + result.stderr) == []
    # generate.py outside deepy.py ends with our own one line, which stays
    assert result.returncode == 0 or "start this script through deepy.py" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_verbose_shows_them_in_the_tools_and_deepy():
    tool = run(TOOL_HELP, NEOX_VERBOSE="1")
    assert tool.returncode == 0 and CORE_NOTICE in tool.stderr
    deepy = run([*DRY_RUN, "--verbose"])
    assert deepy.returncode == 0
    if ON_CPU:
        assert CPU_NOTICE in tool.stdout + tool.stderr and CPU_NOTICE in deepy.stderr
    assert foreign_notices(deepy.stdout) == []  # the report stays clean


STAGE_SCRIPT = """
import time
from megatron.logging import slow_stage
with slow_stage("quick"):
    pass
with slow_stage("slow"):
    time.sleep(2.3)
try:
    with slow_stage("failing"):
        time.sleep(2.3)
        raise ValueError
except ValueError:
    pass
"""


def test_a_stage_says_when_it_starts_and_what_it_took_once_it_runs_over_two_seconds():
    result = run(["-c", STAGE_SCRIPT])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "slow ..." and re.fullmatch(r"slow: done in 2\.\d s", lines[1]), lines
    assert lines[2:] == ["failing ..."]  # no "done" for a stage that failed; a quick one says nothing
    assert run(["-c", STAGE_SCRIPT], RANK="1").stdout == ""  # rank 0 only


CORPUS_SCRIPT = """
import sys
import megatron.logging
megatron.logging.SLOW_STAGE_SECONDS = 0.0  # the real stage, announced however quick this machine builds it
from megatron.data.embedded_corpus import ensure_embedded_corpus
for _ in range(2):
    ensure_embedded_corpus(sys.argv[1], max_files=25, vocab_size=400)
"""


def test_building_the_embedded_corpus_is_a_stage_of_the_first_run_only(tmp_path):
    result = run(["-c", CORPUS_SCRIPT, str(tmp_path)])
    assert result.returncode == 0, result.stderr
    stage = f"building the embedded corpus and training its tokenizer in {tmp_path} (first run only)"
    lines = result.stdout.splitlines()
    assert lines[0] == f"{stage} ..." and re.fullmatch(rf"{re.escape(stage)}: done in \d+\.\d s", lines[1]), lines
    assert len(lines) == 2  # the second call finds it built
