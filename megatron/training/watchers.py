"""Everything that watches the training steps without changing them, as one object the loop feeds.

After each step the loop hands over what the step gave (loss, the objective's metrics, the learning rate,
the time); the watchers turn it into the log line and progress bar, TensorBoard / W&B scalars, the experts'
load report, parameter norms on request, the profiler's window and the non-finite check. ``end_steps``
closes what belongs to the steps (bar, profiler) before the final save and test; ``close`` ends the rest.
"""

from __future__ import annotations

import torch

from megatron.logging import MetricsWriter, ProgressReporter
from megatron.objectives.expert_load import ExpertLoadWatch
from megatron.ranks import global_rank
from megatron.training.diagnostics import StepProfiler, parameter_norms
from megatron.training.divergence import DivergenceSettings, NonFiniteWatch


def _loss_scale(engine) -> float | None:
    if not engine.fp16_enabled():
        return None
    return float(getattr(engine.optimizer, "cur_scale", getattr(engine.optimizer, "loss_scale", 0.0)))


def _skipped_steps(engine) -> int | None:
    """Steps fp16 loss scaling skipped so far (DeepSpeed's count, kept in its checkpoints)."""
    return engine.skipped_steps if engine.fp16_enabled() else None


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if torch.is_tensor(norm) else norm)


class StepWatchers:
    def __init__(self, args, engine, metric_names: tuple[str, ...], first_iteration: int):
        self.engine = engine
        self.metrics = MetricsWriter(args)
        self.expert_load = ExpertLoadWatch(args)
        self.progress = ProgressReporter(args.train_iters, args.log_interval, args.train_batch_size * args.seq_length,
                                         first_iteration=first_iteration,
                                         metric_names=metric_names + self.expert_load.line_names)
        self.nonfinite = NonFiniteWatch(DivergenceSettings.from_args(args))
        self.profiler = StepProfiler(args, global_rank())
        self._norms: dict[str, float] = {}
        self._norm_kinds = {"gradients": args.log_grad_norm, "parameters": args.log_param_norm}

    def before_optimizer_step(self):
        """What the step calls between backward and the optimizer's step: the norms, where asked for."""
        if not any(self._norm_kinds.values()):
            return None
        return lambda: self._norms.update(parameter_norms(self.engine, **self._norm_kinds))

    def before_step(self, iteration: int) -> None:
        self.profiler.before_step(iteration)

    def after_step(self, step: int, loss: float, step_metrics: dict[str, float], lr: float, seconds: float) -> None:
        self.profiler.after_step(step - 1)
        engine = self.engine
        scalars = {"train/loss": loss, **{f"train/{name}": value for name, value in step_metrics.items()},
                   "train/lr": lr, "train/grad_norm": _grad_norm(engine),
                   "train/loss_scale": _loss_scale(engine), "train/skipped_steps": _skipped_steps(engine),
                   "train/step_seconds": seconds, **self.expert_load.scalars(step_metrics)}
        self.metrics.write({**scalars, **self._norms}, step)
        self._norms.clear()
        window = self.progress.step(step, scalars)
        for line in self.expert_load.after_step(step, step_metrics):
            self.progress.message(line)
        if window is not None:
            self.metrics.write({"train/tokens_per_second": window["train/tokens_per_second"]}, step)
        self.nonfinite.after_step(step, loss, scalars["train/grad_norm"], engine.was_step_applied(),
                                  scalars["train/loss_scale"])

    def evaluation(self, step: int, scalars: dict[str, float], line: str) -> None:
        self.metrics.write(scalars, step)
        self.progress.message(line)

    def end_steps(self) -> None:
        self.progress.close()
        self.profiler.close()

    def close(self) -> None:
        self.end_steps()
        self.metrics.close()
