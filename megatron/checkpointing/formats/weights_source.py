"""How the checkpointing layer reads a model folder in another program's format (a Hugging Face folder).

Checkpointing defines the interface and never imports the code that implements it: the caller
(``megatron.training.loop``, the tools) passes an implementation in (``megatron.hf.HF_FOLDER``). The load
plan then treats such a folder as one more checkpoint format, whose weights load module-only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from megatron.contract.architecture import Architecture
    from megatron.contract.lora_settings import LoraSettings


class WeightsSource(Protocol):
    def detect(self, path: Path) -> bool:
        """Whether ``path`` is a folder in this format."""

    def files(self, path: Path) -> tuple[Path, ...]:
        """The files a load reads: the description of the model first, then the weights."""

    def check_architecture(self, path: Path, arch: Architecture) -> None:
        """Raise a CheckpointError naming each field in which the folder's model differs from ``arch``."""

    def read_weights(self, path: Path, arch: Architecture) -> dict[str, torch.Tensor]:
        """The weights under our parameter names, in fp32, after check_architecture."""

    def is_reward_model(self, path: Path) -> bool:
        """Whether the folder holds a reward model (a scalar head in place of the output layer)."""

    def adapter_base(self, path: Path) -> Path | None:
        """For a folder of LoRA adapters, the model folder they sit on (whose weights read_weights includes);
        None for a model folder."""

    def check_adapters(self, path: Path, lora: LoraSettings | None, source_of: Callable[[str], str]) -> None:
        """Raise a CheckpointError naming the setting (`source_of` names its file) and the folder's key where the
        run's LoRA settings `lora` differ from the folder's adapters (a model folder: none to differ from)."""
