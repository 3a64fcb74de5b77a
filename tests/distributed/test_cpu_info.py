"""megatron/runtime/cpu_info.py: DeepSpeed's CPU op builders get py-cpuinfo's answer, asked once, in the background.

Each test runs in a fresh interpreter, where py-cpuinfo is as DeepSpeed finds it in a rank."""

import json
import subprocess
import sys

from tests.deepy_runs import REPO_ROOT

# every call of py-cpuinfo's own function is counted; then DeepSpeed's builders compute their flags
# once before and twice after ask_cpu_info_early() (FusedAdam of the CPU accelerator, CPUAdam of ZeRO-Offload)
COUNTED_BUILDS = """
import json, cpuinfo
calls = []
ask = cpuinfo.get_cpu_info
def counted():
    calls.append(1)
    return ask()
cpuinfo.get_cpu_info = counted
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder
before = FusedAdamBuilder().cxx_args()
asked_before = len(calls)
from megatron.runtime.cpu_info import ask_cpu_info_early
ask_cpu_info_early()
ask_cpu_info_early()
after = [FusedAdamBuilder().cxx_args(), FusedAdamBuilder().cxx_args(), CPUAdamBuilder().cxx_args()]
print(json.dumps({"before": before, "asked_before": asked_before, "after": after, "asked_after": len(calls) - asked_before}))
"""

# the child py-cpuinfo starts gets a SIGTERM, as every process of a job does from a scheduler
SIGNALLED_CHILD = """
import json, os, signal, time
from pathlib import Path
from megatron.runtime.cpu_info import ask_cpu_info_early
ask_cpu_info_early()
children = []
deadline = time.monotonic() + 30
while not children and time.monotonic() < deadline:
    children = [int(pid) for task in Path(f"/proc/{os.getpid()}/task").iterdir()
                for pid in (task / "children").read_text().split()]
for pid in children:
    os.kill(pid, signal.SIGTERM)
import cpuinfo
info = cpuinfo.get_cpu_info()
print(json.dumps({"signalled": len(children), "arch": info.get("arch"), "flags": len(info.get("flags", []))}))
"""


def run_python(code: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_deepspeed_cpu_op_builders_get_the_same_flags_from_one_question():
    seen = run_python(COUNTED_BUILDS)
    assert seen["asked_before"] == 2  # DeepSpeed's own way: a question for -march, another for the SIMD width
    assert seen["asked_after"] == 1
    fused, fused_again, cpu_adam = seen["after"]
    assert fused == fused_again == seen["before"]
    assert any(flag.startswith("-D__") for flag in cpu_adam) and "-march=native" in cpu_adam


def test_a_stop_signal_to_the_question_leaves_an_answer():
    seen = run_python(SIGNALLED_CHILD)
    assert seen["signalled"] >= 1
    assert seen["arch"] and seen["flags"] > 0
