"""Where the data continue after a load, and what a setting changed since the save does to that position.

The position is two sample counts of the saving run: training samples consumed, and validation samples
read by its evaluations (the test split is evaluated once, at the end of a run, from its first sample, so
it has no position to keep). Both count global samples, so they keep their meaning when the micro batch
or the number of data-parallel ranks changes; another `seq_length` cuts the same documents into other
samples, so a count of the old samples points nowhere in the new ones and such a resume is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk.client_state import ClientState

# The settings that say which documents the training samples come from, in which order.
_PATH_SETTINGS = ("data_path", "train_data_paths", "train_label_data_paths", "pos_train_data_paths",
                  "neg_train_data_paths", "pos_train_label_data_paths", "neg_train_label_data_paths")
_DATA_SETTINGS = (*_PATH_SETTINGS, "split", "train_data_weights", "dataset_impl", "pack_impl", "allow_chopped")


@dataclass(frozen=True)
class PositionSettings:
    """The settings that say where the data continue after a load and what a change since the save does to it;
    built once per load plan from the run's settings (`from_args`)."""

    train_batch_size: int | None
    train_micro_batch_size_per_gpu: int | None
    train_iters: int | None
    eval_iters: int
    eval_interval: int | None
    seq_length: int | None
    seq_length_source: str  # the config file that set seq_length (NeoXArgs.source_of)
    pack_impl: str
    data_settings: Mapping[str, Any] = field(default_factory=dict)  # _DATA_SETTINGS by name

    @classmethod
    def from_args(cls, args) -> PositionSettings:
        return cls(args.train_batch_size, args.train_micro_batch_size_per_gpu, args.train_iters, args.eval_iters,
                   args.eval_interval, args.seq_length, args.source_of("seq_length"), args.pack_impl,
                   {name: getattr(args, name) for name in _DATA_SETTINGS})


@dataclass(frozen=True)
class DataPosition:
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    notes: tuple[str, ...] = ()  # how a count the checkpoint does not record was derived


def samples_per_evaluation(eval_iters: int, train_batch_size: int | None) -> int:
    """Validation samples one evaluation reads: eval_iters batches of train_batch_size (0 for settings without a
    batch size, such as a checkpoint's own settings read by a tool)."""
    return eval_iters * (train_batch_size or 0)


def data_position(client: ClientState, iteration: int, settings: PositionSettings) -> DataPosition:
    """The counts a run continues from after iteration `iteration` of a checkpoint (client state `client`)."""
    notes = []
    train = client.consumed_train_samples
    if train is None:  # GPT-NeoX does not record it
        train = iteration * (settings.train_batch_size or 0)
        notes.append(f"no consumed_train_samples recorded: training continues at sample iteration {iteration} x "
                     f"train_batch_size {settings.train_batch_size} = {train}")
    valid = client.consumed_valid_samples
    if valid is None:  # GPT-NeoX and our checkpoints before it was recorded
        evaluations = iteration // settings.eval_interval if settings.eval_interval else 0
        per_evaluation = samples_per_evaluation(settings.eval_iters, settings.train_batch_size)
        valid = evaluations * per_evaluation
        notes.append(f"no consumed_valid_samples recorded: validation continues at sample {valid}, derived as "
                     f"GPT-NeoX does ({evaluations} evaluations up to iteration {iteration} at eval_interval "
                     f"{settings.eval_interval}, {per_evaluation} samples each)")
    return DataPosition(train, valid, tuple(notes) if iteration else ())  # at iteration 0 nothing was derived


def resume_change_notes(settings: PositionSettings, client: ClientState, tag: str, tag_iteration: int | None,
                        position: DataPosition) -> list[str]:
    """One line per setting changed since the save that moves what the data position means; CheckpointError
    where the position cannot be honoured. For loads that keep the checkpoint's data position."""
    notes = []
    if tag_iteration is not None and client.iteration is not None and client.iteration != tag_iteration:
        notes.append(f"tag {tag} records iteration {client.iteration} in its client state: training continues "
                     f"from iteration {client.iteration}, the count its data position and LR schedule belong to")
    if not (position.consumed_train_samples or position.consumed_valid_samples):
        return notes  # nothing read yet (a converted checkpoint, say): the data start at their first sample anyway
    saved = client.settings or {}
    _refuse_other_seq_length(settings, saved, tag)
    notes += _batch_notes(settings, saved)
    notes += _data_notes(settings, saved, position)
    notes += _sample_order_notes(settings, saved, position)
    return notes


def _refuse_other_seq_length(settings: PositionSettings, saved: dict, tag: str) -> None:
    before = saved.get("seq_length")
    if before is None or before == settings.seq_length:
        return
    raise CheckpointError(
        f"{settings.seq_length_source}: seq_length is {settings.seq_length}, but {tag} was trained on samples of "
        f"{before} tokens; its data position counts those samples, which are other samples at {settings.seq_length} "
        f"tokens, so training cannot continue where it stopped. Set seq_length back to {before}, or set "
        "`finetune: true` to train its weights on the new samples from the first one (iteration 0, fresh optimizer)."
    )


def _batch_notes(settings: PositionSettings, saved: dict) -> list[str]:
    before = {name: saved.get(name) for name in ("train_batch_size", "train_micro_batch_size_per_gpu")}
    if None in before.values():
        return []
    now = {"train_batch_size": settings.train_batch_size,
           "train_micro_batch_size_per_gpu": settings.train_micro_batch_size_per_gpu}
    if before == now:
        return []
    if before["train_batch_size"] == now["train_batch_size"]:
        return [f"train_micro_batch_size_per_gpu {before['train_micro_batch_size_per_gpu']} -> "
                f"{now['train_micro_batch_size_per_gpu']} with train_batch_size {now['train_batch_size']} "
                "unchanged: every step trains on the samples it would have, in other micro batches"]
    return [f"train_batch_size {before['train_batch_size']} -> {now['train_batch_size']}: training continues at "
            "the sample the checkpoint reached, and each step from there takes "
            f"{now['train_batch_size']} samples"]


def _data_notes(settings: PositionSettings, saved: dict, position: DataPosition) -> list[str]:
    now = settings.data_settings
    changed = [name for name in _DATA_SETTINGS
               if name in saved and _comparable(name, saved[name]) != _comparable(name, now[name])]
    if not changed:
        return []
    what = ", ".join(f"{name} {saved[name]!r} -> {now[name]!r}" for name in changed)
    return [f"{what}: training continues at sample {position.consumed_train_samples} of the new data, skipping "
            "as many of its samples as the checkpoint had consumed of the old (the same ones if only the files "
            "moved); set `finetune: true` to start the new data at its first sample"]


def _sample_order_notes(settings: PositionSettings, saved: dict, position: DataPosition) -> list[str]:
    """`unpacked` and `pack_until_overflow` draw the order of the samples for the number the run asks for, as
    GPT-NeoX does, so a resume that asks for another number reads other samples from its position on."""
    counts = (saved.get("train_iters"), saved.get("train_batch_size"), settings.train_iters, settings.train_batch_size)
    if settings.pack_impl == "packed" or None in counts:
        return []
    before = saved["train_iters"] * saved["train_batch_size"]
    now = settings.train_iters * settings.train_batch_size
    if before == now:
        return []
    return [f"train_iters x train_batch_size {saved['train_iters']} x {saved['train_batch_size']} -> {settings.train_iters} "
            f"x {settings.train_batch_size}: with pack_impl {settings.pack_impl} the order of the samples is drawn for the "
            f"run's {now} training samples, not the saved run's {before}, so from sample "
            f"{position.consumed_train_samples} on this run reads other samples than the saved run would have "
            "(as in GPT-NeoX); keep both to continue exactly"]


def _comparable(name: str, value):
    """Data paths by the files they name, wherever they are spelled from."""
    if value is None or name not in _PATH_SETTINGS:
        return value
    paths = [value] if isinstance(value, str) else list(value)
    resolved = [os.path.realpath(os.path.expanduser(path)) for path in paths]
    return resolved[0] if isinstance(value, str) else resolved
