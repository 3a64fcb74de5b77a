"""Which frozen base a LoRA run trains its adapters over, recorded in every save of the run, so that an
export of the adapters can name the Hugging Face folder they sit on (PEFT's base_model_name_or_path).

| the run's load                                      | its base                                                |
| a source without adapters (weights only)            | that source; its HF folder: the source itself when it is |
|                                                     | one, a converter's tag's `converted_from` (tags a run    |
|                                                     | saved record none: their weights trained)                |
| a PEFT adapter folder                               | the HF folder its adapter_config.json names             |
| a LoRA tag of ours (resume or fine-tune)            | the base that tag recorded                              |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.checkpointing.ondisk.inventory import FORMAT_HF
from megatron.checkpointing.planning.plan import LoadPlan


@dataclass(frozen=True)
class LoraBase:
    source: str  # the checkpoint directory or Hugging Face folder the base weights were loaded from
    tag: str | None  # the checkpoint's tag; None for a Hugging Face folder
    hf_folder: str | None  # the Hugging Face folder holding exactly these weights; None when there is none

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "tag": self.tag, "hf_folder": self.hf_folder}

    @classmethod
    def from_dict(cls, stored: dict[str, Any] | None) -> LoraBase | None:
        if not stored:
            return None
        return cls(str(stored["source"]), stored.get("tag"), stored.get("hf_folder"))


def lora_base(args, plan: LoadPlan | None) -> LoraBase | None:
    """The base of a LoRA run loaded by ``plan`` (the table above); None without LoRA or when not known."""
    if not args.lora_rank or plan is None or plan.nothing_to_load:
        return None
    if plan.source_format == FORMAT_HF:
        adapter_base = plan.hf_source.adapter_base(plan.load_dir)
        folder = str(adapter_base or plan.load_dir)
        return LoraBase(folder, None, folder)
    if plan.fresh_adapters:
        return LoraBase(str(plan.load_dir), plan.tag, plan.client_state.converted_from)
    return LoraBase.from_dict(plan.client_state.lora_base)
