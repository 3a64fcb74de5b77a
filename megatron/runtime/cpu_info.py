"""py-cpuinfo's answer about this CPU, asked once per process and early, for DeepSpeed's op builders.

DeepSpeed's CPU op builders (FusedAdam on DeepSpeed's CPU accelerator, CPUAdam for ZeRO-Offload on
any machine) call `cpuinfo.get_cpu_info()` twice each time they JIT-load an op, for `-march` and the
SIMD width. Each call starts a fresh interpreter that sleeps a second to time the clock: 2.3 s of
the tiny model's 12 s start-up (tools/bench/bench_startup.py). The answer does not change while the
process runs, so a rank asks once, in a thread, and every later call gets that answer: train.py
asks before its imports, any other process that starts a rank at the latest when it joins the
process group (megatron/runtime/initialize.py).

py-cpuinfo asks in a child process and answers `{}` if that child dies. A scheduler signals every
process of a job, so the child starts with the stop signals blocked: it ends within its second
anyway, and the rank, which stops after the step it is in, still gets an answer.
"""

from __future__ import annotations

import copy
import signal
import threading
from concurrent.futures import Future

from megatron.runtime.stop_signals import STOP_SIGNALS


def ask_cpu_info_early() -> None:
    """Start asking py-cpuinfo in the background; from now on `cpuinfo.get_cpu_info()` returns that answer."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then reads lscpu, which is quick
        return
    if isinstance(getattr(cpuinfo.get_cpu_info, "answer", None), Future):
        return
    ask = cpuinfo.get_cpu_info
    answer: Future = Future()

    def ask_now() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # inherited by the child
        try:
            answer.set_result(ask())
        except Exception as err:  # handed to the caller, as the call itself would have raised it
            answer.set_exception(err)

    def get_cpu_info() -> dict:
        return copy.deepcopy(answer.result())

    get_cpu_info.answer = answer
    cpuinfo.get_cpu_info = get_cpu_info
    threading.Thread(target=ask_now, name="cpuinfo", daemon=True).start()
