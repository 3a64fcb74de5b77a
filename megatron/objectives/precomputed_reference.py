"""Which model wrote a `precompute_model_name` file, so DPO and KTO never compare with another model's
log-probabilities than their reference's.

generate.py (text_gen_type precompute) writes beside each `{data prefix}_{name}.bin/.idx` the file
`{data prefix}_{name}.reference.json`: the identity (megatron/checkpointing/reference.py: source, tag and the
checksum of the weights' files) of the model `load` names. A DPO/KTO run that reads the files works out its
reference as for a live one (plan_reference: what `load` names on a fine-tune, the recorded reference on a
resume), refuses in one line a file that records other weights or none, and records the reference in every
save, as a live one is. Weights are compared by checksum, so a copied or moved checkpoint still matches.

GPT-NeoX's precompute skips a file that exists; here a file the same model wrote is kept too, and one another
model wrote (or one that records none) is refused unless `precompute_overwrite` is set.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from megatron.checkpointing import (
    TRAIN_IMPLS_WITH_REFERENCE,
    CheckpointError,
    LoadSettings,
    ReferenceIdentity,
    inventory_checkpoint,
    plan_for,
    plan_reference,
)
from megatron.data.builders import reference_log_probs_prefix
from megatron.data.errors import DataError
from megatron.fsio import write_text_atomically
from megatron.neox_arguments.errors import ConfigError

SPLITS = ("train", "valid", "test")
_DATA_PATH_SETTINGS = tuple(f"{side}{split}_data_paths" for split in SPLITS for side in ("", "pos_", "neg_"))


@dataclass(frozen=True)
class PrecomputeSettings:
    """The settings that say which files hold the reference log-probabilities, whether a run reads them, and how
    generate.py writes them; built once from the run's settings (`from_args`)."""

    precompute_model_name: str | None
    precompute_overwrite: bool
    train_impl: str
    dpo_reference_free: bool
    dataset_impl: str
    seq_length: int | None
    train_micro_batch_size_per_gpu: int | None
    data_paths: Mapping[str, list[str] | None]  # the {pos_,neg_,}{train,valid,test}_data_paths by name

    @classmethod
    def from_args(cls, args) -> PrecomputeSettings:
        return cls(args.precompute_model_name, args.precompute_overwrite, args.train_impl, args.dpo_reference_free,
                   args.dataset_impl, args.seq_length, args.train_micro_batch_size_per_gpu,
                   {name: getattr(args, name) for name in _DATA_PATH_SETTINGS})


def data_prefixes(settings: PrecomputeSettings) -> list[str]:
    """The data prefixes whose documents have reference log-probabilities, each once."""
    sides = ("pos_", "neg_") if settings.dataset_impl == "pairwise" else ("",)
    prefixes = [path for split in SPLITS for side in sides for path in settings.data_paths[f"{side}{split}_data_paths"] or ()]
    return list(dict.fromkeys(prefixes))


def precomputed_files(settings: PrecomputeSettings) -> dict[str, str]:
    """Each data prefix of the run -> the prefix of its precomputed file, `{prefix}_{precompute_model_name}`."""
    return {prefix: reference_log_probs_prefix(prefix, settings.precompute_model_name)
            for prefix in data_prefixes(settings)}


def record_path(target: str) -> Path:
    return Path(f"{target}.reference.json")


def write_identity(target: str, identity: ReferenceIdentity) -> None:
    write_text_atomically(record_path(target), json.dumps({"reference_model": identity.to_dict()}, indent=1) + "\n")


def read_identity(target: str) -> ReferenceIdentity | None:
    """The identity recorded beside `target`; None when there is no readable record."""
    try:
        return ReferenceIdentity.from_dict(json.loads(record_path(target).read_text())["reference_model"],
                                         record_path(target))
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        return None


def describe(identity: ReferenceIdentity | None) -> str:
    if identity is None:
        return "a model they do not record (no readable .reference.json beside them: written by GPT-NeoX or another tool)"
    return f"{identity.path} (checksum {identity.checksum})"


def uses_precomputed_reference(settings: PrecomputeSettings) -> bool:
    """The objective compares the policy with log-probabilities read from precompute_model_name files."""
    return (bool(settings.precompute_model_name) and settings.train_impl in TRAIN_IMPLS_WITH_REFERENCE
            and not (settings.train_impl == "dpo" and settings.dpo_reference_free))


def precomputed_reference(settings: PrecomputeSettings, load_settings: LoadSettings, policy_plan, data_parallel_size: int,
                          hf_source=None) -> ReferenceIdentity | None:
    """This run's reference (plan_reference's identity) after checking that every precomputed file records it;
    None when the run reads none. megatron.training.loop.setup and deepy.py --dry-run (run_context.check_run_files)
    call it. DataError (or plan_reference's CheckpointError) in one line."""
    if not uses_precomputed_reference(settings):
        return None
    _, identity = plan_reference(load_settings, policy_plan, data_parallel_size, hf_source)
    for target in precomputed_files(settings).values():
        recorded = read_identity(target)
        if recorded is None or recorded.checksum != identity.checksum:
            raise DataError(
                f"precompute_model_name {settings.precompute_model_name!r}: {target}.bin/.idx hold the log-probabilities "
                f"of {describe(recorded)}, but this run's reference model is {describe(identity)}; write them again "
                f"from it (generate.py with text_gen_type: precompute, load: {identity.source}, precompute_overwrite: "
                "true), or unset precompute_model_name to run the reference model live")
    return identity


def identity_of_load(load_settings: LoadSettings, data_parallel_size: int, hf_source=None) -> ReferenceIdentity:
    """The identity of the model `load` names, its weights loaded as generate.py loads them (a fine-tune's load)."""
    stated_by = "precompute (loads the weights only)"
    if not load_settings.load:
        raise ConfigError(f"{stated_by}: finetune: set but `load` is not; say which checkpoint to load")
    weights = load_settings.weights_only(stated_by)
    plan = plan_for(weights, inventory_checkpoint(weights.load, hf_source), data_parallel_size)
    return plan_reference(weights, plan, data_parallel_size, hf_source)[1]


def files_to_write(settings: PrecomputeSettings, identity: ReferenceIdentity, log) -> dict[str, str]:
    """The precomputed files (data prefix -> file prefix) the model of `identity` writes: those missing, and with
    precompute_overwrite those another model wrote. A file it wrote itself is kept (as GPT-NeoX keeps any that exists); one of another
    model, or one that records none, is a DataError unless precompute_overwrite is set."""
    from megatron.data.indexed_dataset import dataset_exists

    missing = {}
    for prefix, target in precomputed_files(settings).items():
        if not dataset_exists(target):
            missing[prefix] = target
            continue
        recorded = read_identity(target)
        if recorded is not None and recorded.checksum == identity.checksum:
            log.info(f"precompute: {target} exists, written by this model ({describe(identity)}), kept")
            continue
        if not settings.precompute_overwrite:
            raise DataError(
                f"precompute: {target}.bin/.idx exist and hold the log-probabilities of {describe(recorded)}, not of "
                f"{describe(identity)} that `load` names; set precompute_overwrite: true to replace them, or choose "
                "another precompute_model_name")
        log.info(f"precompute: {target} holds the log-probabilities of {describe(recorded)}; replacing them "
                 "(precompute_overwrite)")
        missing[prefix] = target
    return missing
