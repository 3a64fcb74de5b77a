"""Precision and ZeRO stage: the two settings the optimizer states of a checkpoint depend on.

Derived one way, from the settings' sections or a saved DeepSpeed config alike, so that what a run
trains with and what a checkpoint was saved with are compared on the same terms.
"""

from __future__ import annotations

from typing import Any

PRECISIONS = ("fp32", "fp16", "bf16")


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled", False))


def precision_of(precision: str | None, fp16: Any, bf16: Any) -> str:
    """``precision`` when set, else what the fp16 / bf16 sections switch on (fp32 when neither)."""
    if precision:
        return precision
    if _enabled(bf16):
        return "bf16"
    if _enabled(fp16):
        return "fp16"
    return "fp32"


def zero_stage_of(zero_optimization: Any, default: int = 0) -> int:
    """The ZeRO stage of a zero_optimization section; ``default`` when it names none."""
    stage = (zero_optimization or {}).get("stage") if isinstance(zero_optimization, dict) else None
    return default if stage is None else stage
