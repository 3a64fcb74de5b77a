"""Other libraries' start-up notices that report nothing wrong with a run, kept off the screen.

On a machine without CUDA, Transformer Engine or Apex, importing DeepSpeed, torch's extension loader
and megatron-core prints up to eight such lines before an entry point or tool says anything (some of
them on every rank), and DeepSpeed prints more while a rank starts. Each is hidden by its own text, so
whatever else those libraries report (a real problem) still shows, and so does every warning of ours.
The CPU-fallback notices stay visible where the machine has an NVIDIA GPU that this process cannot
use: there they are the clue. NEOX_VERBOSE=1 (deepy.py --verbose sets it for every rank it starts)
shows them all.

Every entry point and tool calls `hide_foreign_notices()` before its first heavy import.
"""

from __future__ import annotations

import contextlib
import glob
import io
import logging
import os
import re
import sys
import warnings

VERBOSE_VARIABLE = "NEOX_VERBOSE"

# logger name -> the starts of its records that only say this machine runs on the CPU
CPU_FALLBACK_RECORDS = {
    "DeepSpeed": ("Setting accelerator to CPU", "Setting ds_accelerator to cpu"),
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
}
# starts of warnings.warn messages about what we do not use or cannot change
FOREIGN_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # megatron-core, four times: we use neither
    "`torch.distributed.all_gather_into_tensor` is deprecated",  # torch, about DeepSpeed's ZeRO calls
)
# DeepSpeed's print() on every rank as it joins the process group, also when the op was built before
FOREIGN_PRINT = re.compile(r"DeepSpeed \S+ built successfully\n?$")


def verbose() -> bool:
    return os.environ.get(VERBOSE_VARIABLE, "") not in ("", "0")


class _DropRecords(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def _machine_has_nvidia_gpu() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def hide_foreign_notices() -> None:
    """Hide the notices above in this process, unless NEOX_VERBOSE is set; call before importing
    torch, DeepSpeed or megatron-core (a logger's filter must be in place before it logs)."""
    if verbose():
        return
    for message in FOREIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message))
    if _machine_has_nvidia_gpu():
        return
    for name, starts in CPU_FALLBACK_RECORDS.items():
        logger = logging.getLogger(name)  # the very logger the library gets when it imports
        if not any(isinstance(f, _DropRecords) for f in logger.filters):
            logger.addFilter(_DropRecords(starts))


@contextlib.contextmanager
def foreign_prints_hidden():
    """Run the block with DeepSpeed's known print() lines dropped from stdout (unless NEOX_VERBOSE is
    set); every other line it prints comes out after the block, also when the block fails."""
    if verbose():
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines(keepends=True) if not FOREIGN_PRINT.match(line)]
        sys.stdout.write("".join(kept))
        sys.stdout.flush()
