"""The learning-rate schedule: linear warmup, then decay to ``min_lr`` over ``lr_decay_iters``.

The LR is a pure function of the step number, so a resumed run needs no scheduler state: the step
being taken is ``step`` (1 for the first optimizer step of a run from scratch, ``iteration + 1``
after a checkpoint saved at ``iteration``).

- warmup (``1 <= step <= warmup_iters``): ``peak * step / warmup_iters``; the first step already
  trains, it does not waste a step at LR 0.
- decay (``warmup_iters < step``): ``progress = (step - warmup_iters) / (decay_iters - warmup_iters)``
  clipped to [0, 1]; cosine: ``min + (peak - min) * (1 + cos(pi * progress)) / 2``; linear:
  ``min + (peak - min) * (1 - progress)``; constant: ``peak``. Past ``decay_iters`` the LR stays
  at ``min_lr``.
"""

from __future__ import annotations

import math

DECAY_STYLES = ("constant", "linear", "cosine")


def learning_rate_at(
    step: int,
    *,
    peak_lr: float,
    min_lr: float,
    warmup_iters: int,
    decay_iters: int,
    decay_style: str,
) -> float:
    if decay_style not in DECAY_STYLES:
        raise ValueError(f"lr_decay_style must be one of {DECAY_STYLES}, got {decay_style!r}")
    if step < 1:
        raise ValueError(f"steps are counted from 1, got {step}")
    if warmup_iters > 0 and step <= warmup_iters:
        return peak_lr * step / warmup_iters
    if decay_style == "constant":
        return peak_lr
    decay_span = decay_iters - warmup_iters
    progress = 1.0 if decay_span <= 0 else min(max((step - warmup_iters) / decay_span, 0.0), 1.0)
    if decay_style == "linear":
        return min_lr + (peak_lr - min_lr) * (1.0 - progress)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def learning_rate_for_args(args, step: int) -> float:
    """The LR of optimizer step ``step`` under the run's settings."""
    return learning_rate_at(
        step,
        peak_lr=args.lr,
        min_lr=args.min_lr,
        warmup_iters=args.warmup_iters,
        decay_iters=args.lr_decay_iters,
        decay_style=args.lr_decay_style,
    )


def set_learning_rate(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
