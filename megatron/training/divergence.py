"""Stopping a run whose numbers stopped being numbers, before any of them reach a checkpoint.

In bf16 and fp32 a non-finite loss or gradient norm, or a step DeepSpeed skipped because its
gradients were not finite, ends the run at once: nothing rescales those gradients, so the next
step would not be better. In fp16 a skipped step is how dynamic loss scaling finds its scale;
only more than `max_nonfinite_steps` of them in a row end the run. Every rank takes the same
decision, and the weights are checked once more before every save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.errors import ExpectedError
from megatron.runtime.collective import reported_by_ranks


class DivergenceError(ExpectedError, RuntimeError):
    """Training produced NaN or infinity; the run stops without saving that state."""


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on at least one."""
    return bool(reported_by_ranks(True if flag else None))


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


@dataclass(frozen=True)
class DivergenceSettings:
    """The settings the divergence checks read (each field the setting of that name)."""

    precision: str
    max_nonfinite_steps: int
    save: str | None
    lr: float

    @classmethod
    def from_args(cls, args) -> DivergenceSettings:
        return cls(args.precision, args.max_nonfinite_steps, args.save, args.lr)


def _stop_hint(settings: DivergenceSettings) -> str:
    kept = f"the checkpoints in {settings.save} are untouched" if settings.save else "nothing was saved"
    return (f"training stops without saving this state ({kept}). Lower the learning rate (lr {settings.lr:g}), "
            "check the data, or resume from an earlier checkpoint with other settings.")


class NonFiniteWatch:
    """Looks at every optimizer step's loss, gradient norm and whether DeepSpeed applied it."""

    def __init__(self, settings: DivergenceSettings):
        self.settings = settings
        self.fp16 = settings.precision == "fp16"
        self.limit = settings.max_nonfinite_steps
        self.consecutive_skips = 0

    def after_step(self, iteration: int, loss: float, grad_norm: float | None, step_applied: bool,
                   loss_scale: float | None = None) -> None:
        """Raise DivergenceError, on every rank alike, when this step ends the run."""
        values_finite = _finite(loss) and _finite(grad_norm)
        if self.fp16:
            self.consecutive_skips = 0 if step_applied else self.consecutive_skips + 1
            stop = any_rank((step_applied and not values_finite) or self.consecutive_skips > self.limit)
        else:
            stop = any_rank(not (step_applied and values_finite))
        if not stop:
            return
        if self.fp16 and self.consecutive_skips > self.limit:
            first = iteration - self.consecutive_skips + 1
            raise DivergenceError(
                f"iterations {first}-{iteration} (fp16): {self.consecutive_skips} steps in a row skipped for "
                f"overflowing gradients, more than max_nonfinite_steps ({self.limit}); loss scale now "
                f"{loss_scale:g}, loss {loss:.4g}. The run diverged: {_stop_hint(self.settings)}"
            )
        seen = [f"loss {loss:.4g}"]
        if grad_norm is not None:
            seen.append(f"gradient norm {grad_norm:.4g}")
        if not step_applied:
            seen.append("step skipped by DeepSpeed for non-finite gradients")
        if values_finite and step_applied:
            seen.append("another rank saw a non-finite loss or gradient")
        raise DivergenceError(
            f"iteration {iteration} ({self.settings.precision}): {', '.join(seen)}. The run diverged: "
            f"{_stop_hint(self.settings)}"
        )


def check_weights_finite(engine, iteration: int, settings: DivergenceSettings) -> None:
    """The last line of defence before a save: every rank's weights (its ZeRO-3 partition) are finite."""
    bad = next((name for name, param in engine.module.named_parameters()
                if not bool(torch.isfinite(getattr(param, "ds_tensor", param)).all())), None)
    if any_rank(bad is not None):
        where = f"parameter {bad}" if bad is not None else "another rank's parameters"
        raise DivergenceError(
            f"iteration {iteration} ({settings.precision}): {where} holds NaN or infinity. The run diverged: "
            f"{_stop_hint(settings)}"
        )
