"""Did the shape change: the shape a tag was saved at against this run's, decided once per load by the plan.

A shape is the data-parallel size, tensor-parallel size, ZeRO stage and precision. A full resume at the
saved shape goes through DeepSpeed's own engine.load_checkpoint; at another shape the optimizer state is
resharded (megatron/checkpointing/loading/reshard.py), or refused here in one line when it cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.ondisk.inventory import TagInventory
from megatron.optim.optimizer_layout import precision_of, zero_stage_of


@dataclass(frozen=True)
class Shape:
    data_parallel: int
    tensor_parallel: int
    zero_stage: int
    precision: str

    def describe(self) -> str:
        return f"DP {self.data_parallel} x TP {self.tensor_parallel}, ZeRO-{self.zero_stage}"


@dataclass(frozen=True)
class ShapeChange:
    saved: Shape
    run: Shape

    def describe(self) -> str:
        line = f"full resume at another shape: optimizer state resharded from {self.saved.describe()} to {self.run.describe()}"
        if self.saved.precision != self.run.precision:
            line += (f", {self.saved.precision} to {self.run.precision} (the fp32 master and Adam moments carry "
                     "over as saved)")
        return line

    def notes(self) -> list[str]:
        notes = [self.describe()]
        if self.saved.precision == "fp16" and self.run.precision != "fp16":
            notes.append(f"fp16 loss scaler not carried over: {self.run.precision} trains without one")
        elif self.run.precision == "fp16" and self.saved.precision != "fp16":
            notes.append(f"fp16 loss scaler starts at its initial scale: the {self.saved.precision} checkpoint has none")
        return notes


def saved_shape(tag: TagInventory) -> Shape:
    saved = tag.saved_layout
    return Shape(saved.data_parallel, saved.tensor_parallel, saved.zero_stage, saved.precision)


def run_shape(args, data_parallel_size: int) -> Shape:
    return Shape(data_parallel_size, args.model_parallel_size or 1, zero_stage_of(args.zero_optimization, args.zero_stage),
                 precision_of(args.precision, args.fp16, args.bf16))


def shape_change(tag: TagInventory, args, data_parallel_size: int) -> ShapeChange | None:
    """The change between the shape `tag` was saved at and this run's; None when a same-shape resume does.

    Without ZeRO the whole optimizer state sits in the model-states file, which DeepSpeed loads at
    any data-parallel size: a data-parallel change alone is no change there.
    """
    saved, run = saved_shape(tag), run_shape(args, data_parallel_size)
    if saved.zero_stage == run.zero_stage == 0:
        saved = Shape(run.data_parallel, saved.tensor_parallel, saved.zero_stage, saved.precision)
    if saved == run:
        return None
    return ShapeChange(saved, run)


def refusal(tag: TagInventory, args, way_out: str) -> str | None:
    """Why `tag`'s optimizer state cannot be resharded into this run (one line), or None."""
    if not tag.optimizer_files:
        return (f"{tag.path} keeps its optimizer state inside {layout.model_states_name(0)} (ZeRO stage 0 in "
                f"{tag.metadata.precision}), which DeepSpeed's universal checkpoint cannot read, so it resumes "
                f"only at its own shape (ZeRO stage 0, {tag.metadata.precision}, the same tensor-parallel size). "
                f"Resume there, or {way_out}.")
    if run_shape(args, 1).zero_stage == 0:
        return (f"a full resume of {tag.path} at another shape writes the Adam moments through DeepSpeed's "
                "per-parameter optimizer-state API, which its optimizers without ZeRO do not offer. Set "
                f"zero_optimization.stage to 1, 2 or 3 (or to {tag.metadata.zero_stage} at the saved shape), or {way_out}.")
    return None


def files_read(tag: TagInventory) -> tuple[Path, ...]:
    """Every file a resume at another shape reads: all model-states files and every optimizer shard."""
    return tuple(sorted({*tag.model_states_files.values(), *tag.zero3_model_states_files.values(),
                         *tag.optimizer_files.values()}))
