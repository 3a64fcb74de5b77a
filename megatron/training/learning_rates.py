"""The learning-rate schedule, value for value GPT-NeoX's: linear warmup, then decay over ``lr_decay_iters``.

The LR is a pure function of the step number, so a resumed run needs no scheduler state: the step
being taken is ``step`` (1 for the first optimizer step of a run from scratch, ``iteration + 1``
after a checkpoint saved at ``iteration``). GPT-NeoX's scheduler has taken ``n = step - 1`` steps
when optimizer step ``step`` runs, and sets the LR from ``n``:

- warmup (``n <= warmup_iters``, when ``warmup_iters > 0``): ``peak * max(1, n) / warmup_iters``; the
  first two steps share the smallest warmup LR. A warmup shorter than one step gives the peak.
- decay, with ``d = n - warmup_iters`` and ``span = decay_iters - warmup_iters``:
  linear ``peak * (span - d) / span``; cosine ``min + (peak - min) * (1 + cos(pi * d / span)) / 2``;
  exponential ``peak * exp(-0.693 * d / span)`` (half the peak at the end of the span); constant ``peak``.
- every value is then raised to at least ``min_lr``. So linear decay reaches ``min_lr`` before
  ``decay_iters`` when ``min_lr > 0``, and cosine past ``decay_iters`` climbs back up, as in GPT-NeoX.

``warmup_iters`` is ``warmup x lr_decay_iters`` unrounded (``warmup`` is always a fraction).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "exponential")


@dataclass(frozen=True)
class Schedule:
    """What the LR of every step follows; saved with each checkpoint to check (or restore) on resume."""

    peak_lr: float
    min_lr: float
    warmup_iters: float
    decay_iters: int
    decay_style: str

    @classmethod
    def from_args(cls, args) -> Schedule:
        return cls(args.lr, args.min_lr, args.warmup_iters, args.lr_decay_iters, args.lr_decay_style)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def lr_at(self, step: int) -> float:
        return learning_rate_at(step, peak_lr=self.peak_lr, min_lr=self.min_lr, warmup_iters=self.warmup_iters,
                                decay_iters=self.decay_iters, decay_style=self.decay_style)


def learning_rate_at(
    step: int,
    *,
    peak_lr: float,
    min_lr: float,
    warmup_iters: float,
    decay_iters: int,
    decay_style: str,
) -> float:
    if decay_style not in DECAY_STYLES:
        raise ValueError(f"lr_decay_style must be one of {DECAY_STYLES}, got {decay_style!r}")
    if step < 1:
        raise ValueError(f"steps are counted from 1, got {step}")
    taken = step - 1
    if warmup_iters > 0 and taken <= warmup_iters:
        # A warmup shorter than one step (a small fraction of a short run) ends at the peak, never above it.
        return peak_lr * min(max(1, taken), warmup_iters) / warmup_iters
    into_decay = taken - warmup_iters
    span = decay_iters - warmup_iters
    if span <= 0 and decay_style != "constant":
        return min_lr  # warmup covers the whole decay (GPT-NeoX divides by zero here)
    if decay_style == "linear":
        lr = peak_lr * (span - into_decay) / span
    elif decay_style == "cosine":
        lr = min_lr + (peak_lr - min_lr) / 2.0 * (math.cos(math.pi * into_decay / span) + 1)
    elif decay_style == "exponential":
        lr = peak_lr * math.exp(-0.693 * into_decay / span)
    else:
        lr = peak_lr
    return max(lr, min_lr)


def set_learning_rate(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def schedule_for_resume(configured: Schedule, saved: dict | None, *, override: bool,
                        use_checkpoint: bool) -> tuple[Schedule, str | None]:
    """The schedule a full resume follows, and a line saying which, as GPT-NeoX decides it.

    `override_lr_scheduler`: the configs' schedule; `use_checkpoint_lr_scheduler`: the checkpoint's;
    neither: the two must agree (ValueError naming what differs). A checkpoint that recorded no
    schedule leaves the configs' in force.
    """
    if saved is None:
        return configured, None
    recorded = Schedule(**saved)
    differs = [name for name in Schedule.__dataclass_fields__
               if getattr(recorded, name) != getattr(configured, name)]
    if not differs:
        return configured, None
    changes = ", ".join(f"{name} {getattr(recorded, name)!r} -> {getattr(configured, name)!r}" for name in differs)
    if override:
        return configured, f"override_lr_scheduler: LR schedule from the configs, not the checkpoint ({changes})"
    if use_checkpoint:
        return recorded, f"use_checkpoint_lr_scheduler: LR schedule from the checkpoint, not the configs ({changes})"
    raise ValueError(f"the configs change the checkpoint's LR schedule ({changes}); set override_lr_scheduler: true "
                     "to use the configs' schedule or use_checkpoint_lr_scheduler: true to keep the checkpoint's")
