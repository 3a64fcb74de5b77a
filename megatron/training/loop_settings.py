"""LoopSettings: the run's settings the steps of the training loop read (how many steps, when to evaluate and save,
what a step and an evaluation consume), taken from the whole settings once per run (`from_args`) by
megatron.training.loop's `_train` and handed to its helpers. Each field is the setting of the same name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class LoopSettings:
    train_iters: int
    train_batch_size: int
    eval_interval: int | None
    eval_iters: int
    save: str | None
    checkpoint_factor: int | None
    extra_save_iters: list[int] | None
    train_impl: str
    data_path: str | None
    split: str

    @classmethod
    def from_args(cls, args) -> LoopSettings:
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})
