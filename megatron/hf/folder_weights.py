"""Loading a Hugging Face model directory straight into our parameter names (``load:`` pointing at one), or a
PEFT LoRA adapter folder with the model folder it names (megatron/hf/peft.py).

The weight mapping and the PEFT reader import the model, and with it megatron-core (seconds); they are
imported where weights or adapters are read, so that deepy.py, which only asks whether `load` is such a
folder and what its config says, starts without them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from megatron.contract.architecture import Architecture, architecture_mismatches
from megatron.contract.lora_settings import LoraSettings
from megatron.hf.config import HFModelSpec, is_reward_model_config, spec_from_hf_config
from megatron.hf.errors import HFConversionError
from megatron.hf.io import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    is_hf_model_dir,
    is_peft_dir,
    iter_hf_tensors,
    read_hf_config,
    weight_files,
)
from megatron.hf.shapes import shape_check


def read_hf_model(
    hf_dir: Path, dtype: torch.dtype | None = None, progress: bool = False
) -> tuple[HFModelSpec, dict[str, torch.Tensor]]:
    """What config.json describes, and the weights under our names (cast to ``dtype`` when given)."""
    from megatron.hf.mapping import convert_tensors, hf_to_ours

    hf_dir = Path(hf_dir)
    spec = spec_from_hf_config(read_hf_config(hf_dir), str(hf_dir / CONFIG_NAME))
    arch = spec.architecture()
    tensors = iter_hf_tensors(hf_dir, progress, shape_check(arch))
    return spec, convert_tensors(tensors, hf_to_ours(spec.family, arch), str(hf_dir), dtype)


def check_hf_settings(hf_dir: Path, arch: Architecture) -> None:
    """HFConversionError unless ``arch`` is the model in ``hf_dir``; it names each differing field and both values."""
    hf_dir = Path(hf_dir)
    source = str(hf_dir / CONFIG_NAME)
    theirs = spec_from_hf_config(read_hf_config(hf_dir), source).architecture()
    mismatches = architecture_mismatches(theirs.compared_fields(), arch.compared_fields())
    if mismatches:
        raise HFConversionError(
            f"the model settings do not describe the Hugging Face model in {hf_dir}:\n  "
            + "\n  ".join(m.describe(f"{CONFIG_NAME} says", "the settings say") for m in mismatches)
            + "\nUse the settings that tools/ckpts/convert_hf_to_neox.py --config-out writes for this model."
        )


def load_hf_module_weights(hf_dir: Path, arch: Architecture) -> dict[str, torch.Tensor]:
    """Our-named fp32 tensors of the HF model in ``hf_dir``, after checking ``arch`` is that model."""
    check_hf_settings(hf_dir, arch)
    return read_hf_model(hf_dir, torch.float32)[1]


def _base_and_adapter_weights(peft_dir: Path, arch: Architecture) -> dict[str, torch.Tensor]:
    """The base model's weights and the adapters of ``peft_dir``, our names, fp32, each verified."""
    from megatron.hf.mapping import convert_tensors, hf_to_ours
    from megatron.hf.peft import read_adapters, read_peft_folder

    folder = read_peft_folder(peft_dir)
    base = folder.base_folder()
    check_hf_settings(base, arch)
    spec = spec_from_hf_config(read_hf_config(base), str(base / CONFIG_NAME))
    shapes = {}

    def noting_shapes(tensors):
        for name, tensor in tensors:
            shapes[name] = tensor.shape
            yield name, tensor

    weights = convert_tensors(noting_shapes(iter_hf_tensors(base, check=shape_check(spec.architecture()))),
                              hf_to_ours(spec.family, arch), str(base), torch.float32)
    adapters = read_adapters(folder, folder.lora(spec.family == "gpt_neox", arch.moe), spec.family, arch, shapes)
    return {**weights, **adapters}


class HFFolder:
    """A Hugging Face model folder, or a PEFT adapter folder over one, as a checkpoint the load plan can read
    (checkpointing's WeightsSource)."""

    def detect(self, path: Path) -> bool:
        return is_hf_model_dir(path) or is_peft_dir(path)

    def files(self, path: Path) -> tuple[Path, ...]:
        base = self.adapter_base(path)
        if base is None:
            return (Path(path) / CONFIG_NAME, *weight_files(path))
        return (Path(path) / ADAPTER_CONFIG_NAME, Path(path) / ADAPTER_WEIGHTS_NAME, *self.files(base))

    def check_architecture(self, path: Path, arch: Architecture) -> None:
        check_hf_settings(self.adapter_base(path) or path, arch)

    def read_weights(self, path: Path, arch: Architecture) -> dict[str, torch.Tensor]:
        if is_peft_dir(path):
            return _base_and_adapter_weights(Path(path), arch)
        return load_hf_module_weights(path, arch)

    def is_reward_model(self, path: Path) -> bool:
        return is_reward_model_config(read_hf_config(self.adapter_base(path) or Path(path)))

    def adapter_base(self, path: Path) -> Path | None:
        if not is_peft_dir(path):
            return None
        from megatron.hf.peft import read_peft_folder

        return read_peft_folder(path).base_folder()

    def check_adapters(self, path: Path, lora: LoraSettings | None, source_of: Callable[[str], str]) -> None:
        if is_peft_dir(path):
            from megatron.hf.peft import check_run_lora, read_peft_folder

            check_run_lora(read_peft_folder(path), lora, source_of)


HF_FOLDER = HFFolder()
