"""Checks that a load plan can be carried out with this run's settings, before any engine exists.

Weight-level key/shape mismatches are caught again by strict loading in the engine path; these
checks name the cause in terms of settings, and catch what the engine would miss or load silently
(another data-parallel size, ZeRO stage or precision of the optimizer shards).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable
from pathlib import Path

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.ondisk.inventory import FORMAT_PIPELINE, TagInventory
from megatron.checkpointing.planning import shape
from megatron.checkpointing.planning.load_settings import LoadSettings
from megatron.contract.architecture import architecture_mismatches, fields_of_settings

_SHOWN_MISMATCHES = 3
_MODULE_ONLY_HINT = ("set `no_load_optim: true` (keep iteration and data position, fresh optimizer) "
                     "or `finetune: true` (weights only, start at iteration 0)")


def _check_tensor_parallel(tag: TagInventory, padded_vocab_size: int | None, change: shape.LayoutChange,
                           load_optimizer: bool) -> None:
    """A module-only load re-splits the weights to this run's size; optimizer shards cannot be re-split."""
    if not change.tensor_parallel_changed:
        return
    wanted, saved = change.run_tensor_parallel, change.saved.tensor_parallel
    if load_optimizer and not tag.optimizer_files:  # else resharded (reshard.py)
        raise CheckpointError(
            f"{tag.path} was saved with tensor-parallel size {saved} (mp_rank files for ranks "
            f"{list(tag.mp_ranks)}), this run has model_parallel_size {wanted}; its optimizer shards cannot be "
            f"re-split. Set `model_parallel_size: {saved}` to resume, or {_MODULE_ONLY_HINT} (the weights are "
            "re-split while loading)."
        )
    saved_args = (tag.metadata.saved_args if tag.metadata else None) or {}
    saved_vocab, vocab = saved_args.get("padded_vocab_size"), padded_vocab_size
    if saved_vocab and vocab and saved_vocab != vocab:
        multiple = (saved_args.get("make_vocab_size_divisible_by") or 1) * saved
        hint = (f"set `make_vocab_size_divisible_by: {multiple // wanted}` so this run pads the same way"
                if multiple % wanted == 0 else f"use a model_parallel_size that divides {multiple}")
        raise CheckpointError(
            f"{tag.path} pads the vocabulary to {saved_vocab} rows (make_vocab_size_divisible_by x tensor-parallel "
            f"size {saved}), this run to {vocab} (x {wanted}); the padding rows would not match. {hint[0].upper()}{hint[1:]}."
        )


def _check_architecture(tag: TagInventory, settings: LoadSettings) -> None:
    saved_settings = tag.metadata.saved_args if tag.metadata else None  # in today's meaning (client_state.py)
    if not saved_settings or not settings.load_module_strict:
        return
    mismatches = architecture_mismatches(fields_of_settings(saved_settings), settings.architecture_fields)
    if mismatches:
        shown = "; ".join(m.describe() for m in mismatches[:_SHOWN_MISMATCHES])
        more = f" (and {len(mismatches) - _SHOWN_MISMATCHES} more)" if len(mismatches) > _SHOWN_MISMATCHES else ""
        raise CheckpointError(
            f"the model does not match the checkpoint {tag.path}: {shown}{more}. Use the architecture "
            "settings the checkpoint was saved with (its configs/ folder holds the YAML files), or set "
            "`load_module_strict: false` to load the weights that still fit."
        )


def _expected_optimizer_files(tag: TagInventory, saved_dp: int) -> dict[tuple[int, int], str]:
    prefixes = {layout.OPTIM_STATES_RE.match(p.name).group(1) for p in tag.optimizer_files.values()}
    prefix = next(iter(prefixes)) if len(prefixes) == 1 else None
    return {(dp, mp): layout.optim_states_name(dp, mp, prefix)
            for mp in (tag.engine_mp_ranks or (0,)) for dp in range(saved_dp)}


def loads_universal(tag: TagInventory, deepspeed_extra_args: dict | None) -> bool:
    """A full resume of `tag` reads its universal checkpoint (ds_to_universal's zero/ folder) instead of the shards."""
    return tag.universal and bool(((deepspeed_extra_args or {}).get("checkpoint") or {}).get("load_universal"))


def _check_resume(tag: TagInventory, settings: LoadSettings, change: shape.ShapeChange | None) -> None:
    _check_pipeline_stages(tag, settings.pipe_parallel_size)
    if not tag.has_optimizer_states:
        raise CheckpointError(
            f"full resume asks for optimizer states, but {tag.path} holds none (no "
            f"*zero_pp_rank_<DP>_mp_rank_<MP>_optim_states.pt files, no optimizer in "
            f"{layout.model_states_name(0)}). To start from its weights, {_MODULE_ONLY_HINT}."
        )
    meta = tag.metadata
    if meta.zero_stage != 0:  # else the whole optimizer state sits in the model-states file
        _check_shards_complete(tag)
    problem = change and shape.refusal(tag, settings, _MODULE_ONLY_HINT)
    if change and tag.format == FORMAT_PIPELINE:
        problem = (f"{tag.path} is a pipeline checkpoint saved at {change.saved.describe()}, this run is "
                   f"{change.run.describe()}; a pipeline's optimizer shards resume at their own shape only. "
                   f"Resume there, or {_MODULE_ONLY_HINT}.")
    if problem:
        raise CheckpointError(problem)


def _check_pipeline_stages(tag: TagInventory, pipe_parallel_size: int | None) -> None:
    """A pipeline tag resumes in DeepSpeed's pipe engine at its number of stages, any other tag outside it."""
    pipelined_tag, stages = tag.format == FORMAT_PIPELINE, pipe_parallel_size or 0
    if pipelined_tag == (stages > 1) and (not pipelined_tag or tag.saved_pp_size == stages):
        return
    if pipelined_tag:
        saved, resume = (f"is a pipeline checkpoint of {tag.saved_pp_size} stage(s) (layer files)",
                         f"Set `pipe_parallel_size: {tag.saved_pp_size}` to resume, or " if tag.saved_pp_size > 1 else "")
    else:
        saved, resume = "was saved without a pipeline", "Set `pipe_parallel_size: 0` to resume, or "
    raise CheckpointError(
        f"{tag.path} {saved}, this run has pipe_parallel_size {stages}; a full resume restores each stage's "
        f"optimizer shards as they were saved. {resume or 'To load its weights, '}{_MODULE_ONLY_HINT} (the weights "
        "move between pipeline sizes)."
    )


def _check_shards_complete(tag: TagInventory) -> None:
    saved_stage = tag.metadata.zero_stage
    saved_dp = tag.saved_layout.data_parallel
    expected = _expected_optimizer_files(tag, saved_dp)
    missing = [name for key, name in expected.items() if key not in tag.optimizer_files]
    if saved_stage == 3:
        missing += [layout.zero3_model_states_name(dp, mp) for dp, mp in expected
                    if (dp, mp) not in tag.zero3_model_states_files]
    if missing:
        raise CheckpointError(
            f"{tag.path} is incomplete: saved by {saved_dp} data-parallel ranks, but "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
            f"({len(missing)} file(s)) are missing. Restore them, load another tag with `iteration: N`, "
            f"or {_MODULE_ONLY_HINT}."
        )


def check_files_intact(paths) -> None:
    """Every torch file ends with its zip directory; a truncated one (an interrupted save) does not.

    Reads only each file's tail. Files in torch's legacy (pre-1.6, non-zip) format pass unchecked.
    """
    for path in paths:
        if path.suffix not in (".pt", ".bin"):
            continue
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing; it was there when the directory was listed.")
        if zipfile.is_zipfile(path):
            continue
        with open(path, "rb") as handle:
            legacy = handle.read(1) == b"\x80"  # a pickle stream: torch's legacy format
        if not legacy:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or corrupt (no zip directory at its end; "
                f"{path.stat().st_size} bytes), e.g. from an interrupted save. Restore it, or load another "
                "tag with `iteration: N`."
            )


def _check_masters_loaded(tag: TagInventory, settings: LoadSettings) -> None:
    """DeepSpeed's ZeRO optimizers (stage 1-3) load a 16-bit run's fp32 master weights from the saved fp32 copies
    unless zero_optimization.load_from_fp32_weights is false; then they round the 16-bit weights up instead, and
    the resume is no longer exact. A full resume promises exactness, so it is refused rather than run so."""
    extra = (settings.deepspeed_extra_args or {}).get("zero_optimization") or {}  # merged into the section
    zero = {**(settings.zero_optimization or {}), **extra}
    if settings.zero_stage < 1 or settings.precision not in ("fp16", "bf16") or zero.get("load_from_fp32_weights", True):
        return
    setting = "deepspeed_extra_args" if "load_from_fp32_weights" in extra else "zero_optimization"
    raise CheckpointError(
        f"{settings.source_of(setting)}: zero_optimization.load_from_fp32_weights is false, so this full "
        f"resume of {tag.path} would rebuild the fp32 master weights from the {settings.precision} weights instead of "
        "loading the saved fp32 copies, and the resume would not be exact; remove the key (DeepSpeed's default is "
        f"true), or {_MODULE_ONLY_HINT}")


def check_plan(files: Iterable[Path], load_optimizer: bool, tag: TagInventory, settings: LoadSettings,
               change: shape.LayoutChange) -> None:
    """Raise CheckpointError when a plan reading `files` (and the optimizer states when `load_optimizer`, at
    the shape change the plan decided) cannot be carried out with these settings."""
    check_files_intact(files)
    _check_tensor_parallel(tag, settings.padded_vocab_size, change, load_optimizer)
    _check_architecture(tag, settings)
    if load_optimizer:
        _check_resume(tag, settings, change.resume)
        _check_masters_loaded(tag, settings)
