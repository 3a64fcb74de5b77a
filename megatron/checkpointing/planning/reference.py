"""The frozen reference model of DPO and KTO: which weights it is, decided with the policy's load plan and
recorded in every save, so a resumed run compares against exactly the model it started from.

| the policy's load      | the reference                                                                   |
| `finetune: true`       | what `load` names (the tag the policy loads, or the Hugging Face folder)         |
| a resume of our save   | the source, tag and checksum that save recorded, read again and checked          |
| nothing (no `load`)    | refused: there is no model to compare against                                   |

GPT-NeoX loads its reference from `load` with the policy's flags, so a resumed DPO run compares the policy
with its own last checkpoint. Here a resume never takes the reference from the resumed policy: it reads the
recorded source and refuses in one line when that is gone or its weights changed. The checksum is a digest
of the checksum of every file the reference's module-only load reads (the manifest's where the tag has one;
otherwise a CRC-32 computed here, as runs recorded before saves moved to XXH3, so their identities still
match), so it does not depend on the tensor-parallel layout that reads them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.weights_source import WeightsSource
from megatron.checkpointing.ondisk import layout, manifest
from megatron.checkpointing.ondisk.inventory import inventory_checkpoint
from megatron.checkpointing.planning.plan import LoadMode, LoadPlan, build_load_plan

TRAIN_IMPLS_WITH_REFERENCE = ("dpo", "kto")
_UNLISTED_FILE_CHECKSUM = "crc32"  # fixed: identities recorded by earlier runs must keep matching


@dataclass(frozen=True)
class ReferenceIdentity:
    source: str  # the checkpoint directory or Hugging Face folder
    tag: str | None  # the checkpoint's tag; None for a Hugging Face folder
    checksum: str

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "tag": self.tag, "checksum": self.checksum}

    @classmethod
    def from_dict(cls, stored: dict[str, Any] | None) -> ReferenceIdentity | None:
        if not stored:
            return None
        return cls(str(stored["source"]), stored.get("tag"), str(stored["checksum"]))

    @property
    def path(self) -> Path:
        return Path(self.source) / self.tag if self.tag else Path(self.source)


def needs_reference(args) -> bool:
    """The objective compares the policy with a live frozen reference model."""
    if args.train_impl not in TRAIN_IMPLS_WITH_REFERENCE:
        return False
    return not (args.precompute_model_name or (args.train_impl == "dpo" and args.dpo_reference_free))


def weights_checksum(plan: LoadPlan) -> str:
    """A digest of the checksum of each file a module-only `plan` reads."""
    root = plan.tag_dir if plan.tag_dir is not None else plan.load_dir
    records = plan.tag_inventory.manifest if plan.tag_inventory is not None else None
    lines = []
    for path in sorted(plan.files):
        # a PEFT adapter folder's plan also reads its base model's files, which lie outside the folder
        name = Path(path).relative_to(root).as_posix() if Path(path).is_relative_to(root) else Path(path).as_posix()
        record = (records or {}).get(name)
        digest = (f"{record.checksum}:{record.digest}" if record is not None else
                  f"{_UNLISTED_FILE_CHECKSUM}:{manifest.file_checksum(path, _UNLISTED_FILE_CHECKSUM)}")
        lines.append(f"{name} {digest}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def plan_reference(args, policy_plan: LoadPlan | None, data_parallel_size: int,
                   hf_source: WeightsSource | None = None) -> tuple[LoadPlan, ReferenceIdentity]:
    """The module-only plan that loads the reference model and the identity every save records;
    CheckpointError (one line) when there is no reference to load or the recorded one is gone or changed."""
    if policy_plan is None or policy_plan.nothing_to_load:
        raise CheckpointError(
            f"train_impl {args.train_impl} compares the policy with the model it starts from, but "
            f"{'`load` is not set' if policy_plan is None else f'{policy_plan.load_dir} holds no checkpoint yet'}. "
            "Set `load` to the checkpoint or Hugging Face folder to start from, with `finetune: true`"
            + (", or set `dpo_reference_free: true`." if args.train_impl == "dpo" else "."))
    if policy_plan.mode is LoadMode.FINETUNE:
        return policy_plan, ReferenceIdentity(str(policy_plan.load_dir), policy_plan.tag,
                                              weights_checksum(policy_plan))
    recorded = ReferenceIdentity.from_dict(policy_plan.client_state.reference_model)
    if recorded is None:
        raise CheckpointError(
            f"{policy_plan.tag_dir} records no reference model (saved by a run without a live one: another "
            "train_impl, dpo_reference_free or precompute_model_name; or by another program), so this resume cannot "
            f"know which model {args.train_impl} compares against. Set `finetune: true` to start from its weights "
            "(they become the reference).")
    plan = _recorded_plan(args, recorded, policy_plan, data_parallel_size, hf_source)
    checksum = weights_checksum(plan)
    if checksum != recorded.checksum:
        raise CheckpointError(
            f"the reference model of this run, {recorded.path} (recorded in {policy_plan.tag_dir}), changed since "
            f"the run started: its files' checksum is {checksum}, the run recorded {recorded.checksum}. Restore it, "
            "or start a new run with `finetune: true`.")
    return plan, recorded


def _recorded_plan(args, recorded: ReferenceIdentity, policy_plan: LoadPlan, data_parallel_size: int,
                   hf_source: WeightsSource | None) -> LoadPlan:
    where = f"the reference model of this run, {recorded.path} (recorded in {policy_plan.tag_dir})"
    if not recorded.path.exists():
        raise CheckpointError(f"{where}, is gone; a resume never takes the reference from the resumed policy. "
                              "Restore it at that path, or start a new run with `finetune: true`.")
    iteration = layout.iteration_of_tag(recorded.tag) if recorded.tag else None
    settings = args.with_values({"load": recorded.source, "finetune": True, "no_load_optim": False,
                                 "iteration": iteration}, where)
    try:
        return build_load_plan(settings, inventory_checkpoint(recorded.source, hf_source), data_parallel_size)
    except CheckpointError as err:
        raise CheckpointError(f"{where} cannot be loaded: {err}") from None


def describe(identity: ReferenceIdentity, resumed: bool, adapters_off: bool = False) -> str:
    origin = "recorded by the checkpoint this run resumes" if resumed else "the model this fine-tune starts from"
    held = ("this run's own frozen base with its LoRA adapters switched off, no second model in memory"
            if adapters_off else "weights only, frozen")
    return f"reference model: {identity.path} ({origin}), {held}, checksum {identity.checksum}; recorded in every save"
