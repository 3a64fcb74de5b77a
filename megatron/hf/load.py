"""Loading a Hugging Face model directory straight into our parameter names (``load:`` pointing at one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron.hf.config import HFModelSpec, architecture_mismatches, spec_from_hf_config
from megatron.hf.errors import HFConversionError
from megatron.hf.io import CONFIG_NAME, iter_hf_tensors, read_hf_config
from megatron.hf.mapping import convert_tensors, hf_to_ours
from megatron.model.architecture import architecture_from_args


def read_hf_model(
    hf_dir: Path, dtype: torch.dtype | None = None, progress: bool = False
) -> tuple[HFModelSpec, dict[str, torch.Tensor]]:
    """What config.json describes, and the weights under our names (cast to ``dtype`` when given)."""
    hf_dir = Path(hf_dir)
    spec = spec_from_hf_config(read_hf_config(hf_dir), str(hf_dir / CONFIG_NAME))
    direction = hf_to_ours(spec.family, spec.architecture())
    return spec, convert_tensors(iter_hf_tensors(hf_dir, progress), direction, str(hf_dir), dtype)


def check_hf_settings(hf_dir: Path, args: Any) -> None:
    """HFConversionError unless ``args`` describes the model in ``hf_dir``; it names each differing setting."""
    hf_dir = Path(hf_dir)
    source = str(hf_dir / CONFIG_NAME)
    theirs = spec_from_hf_config(read_hf_config(hf_dir), source).architecture()
    mismatches = architecture_mismatches(architecture_from_args(args), theirs, source)
    if mismatches:
        raise HFConversionError(
            f"the model settings do not describe the Hugging Face model in {hf_dir}:\n  "
            + "\n  ".join(mismatches)
            + "\nUse the settings that tools/ckpts/convert_hf_to_neox.py --config-out writes for this model."
        )


def load_hf_module_weights(hf_dir: Path, args: Any) -> dict[str, torch.Tensor]:
    """Our-named fp32 tensors of the HF model in ``hf_dir``, after checking ``args`` describes that model."""
    check_hf_settings(hf_dir, args)
    return read_hf_model(hf_dir, torch.float32)[1]
