"""Which weights a run was made from, as its saves record them: the DPO/KTO reference model
(ReferenceIdentity), the frozen base under a LoRA run's adapters (LoraBase), the reward model scoring a
REINFORCE run's completions (RewardModelIdentity). A source folder, a tag in it, and
a checksum of the files a module-only load of them reads, so a later load can tell that they are still the
same weights; a LoRA base also names the Hugging Face folder holding exactly those weights, when one does
(PEFT's base_model_name_or_path in an export of the adapters).

The checksum is a digest of the checksum of every such file (the manifest's where the tag has one;
otherwise a CRC-32 computed here, as runs recorded before saves moved to XXH3, so their identities still
match); it does not depend on the tensor-parallel layout that reads them.

A save records its identities in its client state. A PEFT adapter folder has no place for one (PEFT's
adapter_config.json has no field for it), so its export writes the same LoraBase record into a small file
beside it (LORA_BASE_FILE), which a load of the folder checks as a load of an adapter-only tag does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Self

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import manifest
from megatron.checkpointing.ondisk.client_state import LORA_BASE_KEY, REFERENCE_MODEL_KEY, REWARD_MODEL_KEY

_UNLISTED_FILE_CHECKSUM = "crc32"  # fixed: identities recorded by earlier runs must keep matching


@dataclass(frozen=True)
class ReferenceIdentity:
    source: str  # the checkpoint directory or Hugging Face folder
    tag: str | None  # the checkpoint's tag; None for a Hugging Face folder
    checksum: str

    # how a save's client state holds it, and what a damaged record costs
    RECORD: ClassVar[tuple[str, str, str]] = (
        REFERENCE_MODEL_KEY, "the reference model", "this run cannot know which model its policy is compared with")

    def to_dict(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in fields(self)}

    @classmethod
    def from_dict(cls, stored: Any, where: Path) -> Self | None:
        """The record that ``where`` (a tag, a record file) holds; CheckpointError in one line when it is not one."""
        if not stored:
            return None
        names = [field.name for field in fields(cls)]
        problem = ("is not a mapping" if not isinstance(stored, Mapping) else
                   next((f"has no {name!r}" for name in _REQUIRED_TEXTS if not isinstance(stored.get(name), str)),
                        None) or
                   next((f"has a {name!r} that is not text" for name in names
                         if not isinstance(stored.get(name), (str, type(None)))), None))
        if problem:
            key, what, consequence = cls.RECORD
            raise CheckpointError(
                f"{where}: its record of {what} (client state '{key}') {problem}, so {consequence}. Restore the tag "
                "from a copy, or load another tag with `iteration: N`.")
        return cls(**{name: stored.get(name) for name in names})

    @property
    def path(self) -> Path:
        return Path(self.source) / self.tag if self.tag else Path(self.source)


_REQUIRED_TEXTS = ("source", "checksum")


@dataclass(frozen=True)
class LoraBase(ReferenceIdentity):
    hf_folder: str | None = None  # the Hugging Face folder holding exactly these weights; None when none does

    RECORD: ClassVar[tuple[str, str, str]] = (
        LORA_BASE_KEY, "the base model under its LoRA adapters", "the adapters cannot be checked against their base")


@dataclass(frozen=True)
class RewardModelIdentity(ReferenceIdentity):
    RECORD: ClassVar[tuple[str, str, str]] = (
        REWARD_MODEL_KEY, "the reward model", "this run cannot know which reward model scored its completions")


def files_checksum(files: Iterable[Path], root: Path, records: Mapping[str, manifest.FileRecord] | None) -> str:
    """A digest of the checksum of each of `files` (under `root`), taken from `records` (a manifest) where listed."""
    lines = []
    for path in sorted(files):
        # a PEFT adapter folder's plan also reads its base model's files, which lie outside the folder
        name = Path(path).relative_to(root).as_posix() if Path(path).is_relative_to(root) else Path(path).as_posix()
        record = (records or {}).get(name)
        digest = (f"{record.checksum}:{record.digest}" if record is not None else
                  f"{_UNLISTED_FILE_CHECKSUM}:{manifest.file_checksum(path, _UNLISTED_FILE_CHECKSUM)}")
        lines.append(f"{name} {digest}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


LORA_BASE_FILE = "lora_base.json"  # beside a PEFT folder's adapter_config.json: the base it was trained over


def write_lora_base_file(folder: Path, base: LoraBase) -> None:
    (Path(folder) / LORA_BASE_FILE).write_text(json.dumps(base.to_dict(), indent=2, sort_keys=True) + "\n")


def read_lora_base_file(folder: Path) -> LoraBase | None:
    """The base record beside a PEFT folder's adapters; None where there is none (a folder written elsewhere);
    CheckpointError in one line for a record that cannot be read."""
    path = Path(folder) / LORA_BASE_FILE
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot be read as JSON ({err}), so the adapters cannot be checked against "
                              "their base; export the adapters again, or delete it to load them unverified") from None
    return LoraBase.from_dict(stored, path) or None
