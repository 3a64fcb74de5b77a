"""Did the shape change: the layout a tag was saved at against this run's, decided once per load by the plan.

``layout_change`` is the one answer every reader asks (the plan's notes, its checks, the loader's choice of
a pipeline tag's layer files, the reshard): whether the tensor-parallel split changed, where the experts
go, and, for a full resume, the change of shape. A shape is the data-parallel size, tensor-parallel size,
ZeRO stage and precision. A full resume at the saved shape goes through DeepSpeed's own
engine.load_checkpoint; at another shape the optimizer state is resharded
(megatron/checkpointing/loading/reshard.py), or refused here in one line when it cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.ondisk.inventory import SavedLayout, TagInventory
from megatron.checkpointing.planning.load_settings import LoadSettings
from megatron.contract.architecture import experts_per_rank
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


@dataclass(frozen=True)
class LayoutChange:
    """A tag's saved layout against this run's: the answer to every "did it change" of one load."""

    saved: SavedLayout
    run_tensor_parallel: int
    run_experts: int | None
    resume: ShapeChange | None  # a full resume at another shape; None for a module-only load or the same shape

    @property
    def tensor_parallel_changed(self) -> bool:
        return self.saved.tensor_parallel != self.run_tensor_parallel

    def resplit_notes(self, load_optimizer: bool) -> list[str]:
        """What a load across tensor-parallel sizes does with the weights and the experts."""
        if not self.tensor_parallel_changed:
            return []
        saved_tp, run_tp = self.saved.tensor_parallel, self.run_tensor_parallel
        notes = [] if load_optimizer else [f"weights re-split from tensor-parallel size {saved_tp} to {run_tp} "
                                           "while loading (each rank reads only its slices)"]
        if self.saved.experts > 1 and self.saved.experts == self.run_experts:  # else the architecture check refuses
            notes.append(f"experts {self.saved.experts_per_rank} per rank -> {experts_per_rank(self.saved.experts, run_tp)}: "
                         f"whole experts from the {saved_tp} rank file(s) to this run's {run_tp} tensor-parallel rank(s)")
        return notes


def layout_change(tag: TagInventory, settings: LoadSettings, data_parallel_size: int, resume: bool) -> LayoutChange:
    """The change between `tag`'s saved layout and this run's; `resume`: a full resume through the shards."""
    return LayoutChange(tag.saved_layout, settings.model_parallel_size or 1, settings.moe_num_experts,
                        shape_change(tag, settings, data_parallel_size) if resume else None)


def saved_shape(tag: TagInventory) -> Shape:
    saved = tag.saved_layout
    return Shape(saved.data_parallel, saved.tensor_parallel, saved.zero_stage, saved.precision)


def run_shape(settings: LoadSettings, data_parallel_size: int) -> Shape:
    return Shape(data_parallel_size, settings.model_parallel_size or 1,
                 zero_stage_of(settings.zero_optimization, settings.zero_stage),
                 precision_of(settings.precision, settings.fp16, settings.bf16))


def shape_change(tag: TagInventory, settings: LoadSettings, data_parallel_size: int) -> ShapeChange | None:
    """The change between the shape `tag` was saved at and this run's; None when a same-shape resume does.

    Without ZeRO the whole optimizer state sits in the model-states file, which DeepSpeed loads at
    any data-parallel size: a data-parallel change alone is no change there.
    """
    saved, run = saved_shape(tag), run_shape(settings, data_parallel_size)
    if saved.zero_stage == run.zero_stage == 0:
        saved = Shape(run.data_parallel, saved.tensor_parallel, saved.zero_stage, saved.precision)
    if saved == run:
        return None
    return ShapeChange(saved, run)


def refusal(tag: TagInventory, settings: LoadSettings, way_out: str) -> str | None:
    """Why `tag`'s optimizer state cannot be resharded into this run (one line), or None."""
    if not tag.optimizer_files:
        return (f"{tag.path} keeps its optimizer state inside {layout.model_states_name(0)} (ZeRO stage 0 in "
                f"{tag.metadata.precision}), which DeepSpeed's universal checkpoint cannot read, so it resumes "
                f"only at its own shape (ZeRO stage 0, {tag.metadata.precision}, the same tensor-parallel size). "
                f"Resume there, or {way_out}.")
    if run_shape(settings, 1).zero_stage == 0:
        return (f"a full resume of {tag.path} at another shape writes the Adam moments through DeepSpeed's "
                "per-parameter optimizer-state API, which its optimizers without ZeRO do not offer. Set "
                f"zero_optimization.stage to 1, 2 or 3 (or to {tag.metadata.zero_stage} at the saved shape), or {way_out}.")
    return None


def files_read(tag: TagInventory) -> tuple[Path, ...]:
    """Every file a resume at another shape reads: all model-states files and every optimizer shard."""
    return tuple(sorted({*tag.model_states_files.values(), *tag.zero3_model_states_files.values(),
                         *tag.optimizer_files.values()}))
