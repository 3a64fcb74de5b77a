"""PEFT adapter folders: LoRA adapters of ours written as PEFT saves them, and read back to start a run.

A folder holds ``adapter_config.json`` (PEFT's LoraConfig) and ``adapter_model.safetensors``, whose keys
are the PEFT model's parameter names without the adapter's name: ``base_model.model.`` + the HF module
(``model.layers.0.self_attn.q_proj``, ``gpt_neox.layers.0.attention.query_key_value``) + ``.lora_A.weight``
or ``.lora_B.weight``. Each of our adapters is one HF module's (megatron/model/lora.py), so the tensors
are ours as they are, under another name. Only safetensors and json are read or written: a folder loads
and exports without PEFT installed, and no byte of it is unpickled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron.contract.architecture import ModelConfigError
from megatron.contract.lora_settings import ALL_LINEAR, LoraSettings, target_modules_of
from megatron.hf.errors import HFConversionError
from megatron.hf.io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, is_hf_model_dir
from megatron.hf.mapping import hf_linear_module
from megatron.model.gpt_model import layer_key

_PEFT_PREFIX = "base_model.model."
SIDES = ("A", "B")
# PEFT options that change what an adapter computes, each with the value of a plain LoRA adapter
_PLAIN_LORA = {"use_dora": False, "bias": "none", "fan_in_fan_out": False, "lora_bias": False,
               "modules_to_save": None, "layers_to_transform": None, "layer_replication": None,
               "rank_pattern": {}, "alpha_pattern": {}, "target_parameters": None, "trainable_token_indices": None}


def peft_names(lora: LoraSettings, family: str, num_layers: int) -> dict[str, str]:
    """Our name of each adapter weight -> its key in a PEFT folder of the HF model ``family``."""
    if lora.gpt_neox != (family == "gpt_neox"):
        raise HFConversionError(f"LoRA targets {', '.join(lora.target_modules)} are not module names of Hugging "
                                f"Face {family}; export the model with the family its architecture implies")
    names = {}
    for layer in range(num_layers):
        for module, target in lora.targets().items():
            for side in SIDES:
                ours = f"sequential.{layer_key(layer)}.{target.linear}.lora.{module}.lora_{side}"
                names[ours] = f"{_PEFT_PREFIX}{hf_linear_module(family, layer, module)}.lora_{side}.weight"
    return names


def _module_and_side(peft_key: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> ('model.layers.0.self_attn.q_proj', 'A')."""
    module, side = peft_key.removeprefix(_PEFT_PREFIX).removesuffix(".weight").rsplit(".lora_", 1)
    return module, side


def merge_into(hf_weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scaling: float) -> None:
    """W + scaling * B A for each adapted module of ``hf_weights`` (HF names), computed in fp32; ``adapters``
    by PEFT key. The merged weights stay fp32: the caller casts them once, so no rounding comes between."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapters.items():
        module, side = _module_and_side(key)
        pairs.setdefault(module, {})[side] = tensor.float()
    for module, pair in pairs.items():
        name = f"{module}.weight"
        hf_weights[name] = hf_weights[name].float() + scaling * (pair["B"] @ pair["A"])


def adapter_config(lora: LoraSettings, base_model: str) -> dict[str, Any]:
    """PEFT's LoraConfig of these adapters, over the HF model folder ``base_model``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": int(lora.alpha) if lora.alpha.is_integer() else lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": list(lora.target_modules), "use_rslora": lora.use_rslora,
            "init_lora_weights": True, "inference_mode": True, **_PLAIN_LORA}


def write_peft_dir(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_WEIGHTS_NAME),
              metadata={"format": "pt"})


@dataclass(frozen=True)
class PeftFolder:
    """A PEFT LoRA adapter folder, its adapter_config.json checked."""

    path: Path
    settings: dict[str, Any]  # the run's lora_* settings it gives
    base: str | None  # base_model_name_or_path as written

    @property
    def config_file(self) -> Path:
        return self.path / ADAPTER_CONFIG_NAME

    @property
    def weights_file(self) -> Path:
        return self.path / ADAPTER_WEIGHTS_NAME

    def base_folder(self) -> Path:
        """The local Hugging Face folder the adapter sits on; one line saying what to do when there is none."""
        where = f"{self.config_file}: base_model_name_or_path"
        if not self.base:
            raise HFConversionError(f"{where} is not set; set it to the local Hugging Face model folder the adapter "
                                    "was trained on")
        folder = Path(self.base).expanduser().resolve()  # PEFT reads a relative path from the working directory
        if not is_hf_model_dir(folder):
            raise HFConversionError(f"{where} {self.base!r} is no local Hugging Face model folder (config.json and "
                                    "weights); download that model into a folder and set base_model_name_or_path "
                                    "to it")
        return folder

    def lora(self, gpt_neox: bool) -> LoraSettings:
        """The adapters' LoRA on a model of GPT-NeoX's family (else Llama's); ModelConfigError for a target
        module that model lacks."""
        values = self.settings
        return LoraSettings(values["lora_rank"], values["lora_alpha"], values["lora_dropout"],
                            target_modules_of(values["lora_target_modules"], gpt_neox), values["lora_use_rslora"],
                            gpt_neox)


def _config_problem(config: dict[str, Any]) -> tuple[str, str] | None:
    """(key, what is wrong) for the first setting of ``config`` this trainer's LoRA does not compute."""
    if config.get("peft_type") != "LORA":
        return "peft_type", f"is {config.get('peft_type')!r}; only LoRA adapters (peft_type 'LORA') load here"
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        return "r", f"is {rank!r}; a LoRA rank is a positive integer"
    for key in ("lora_alpha", "lora_dropout"):
        value = config.get(key, 0.0 if key == "lora_dropout" else None)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            return key, f"is {value!r}; it must be a number"
    for key, plain in _PLAIN_LORA.items():
        value = config.get(key, plain)
        if not (value is None or value == plain or value in ({}, [])):
            return key, (f"is {value!r}; only plain LoRA adapters on the linear layers load here (train without "
                         f"this option: {key} {plain!r})")
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        return "target_modules", f"is the pattern {targets!r}; list the module names instead (q_proj, ...)"
    if not isinstance(targets, str) and not (isinstance(targets, list) and targets
                                             and all(isinstance(t, str) for t in targets)):
        return "target_modules", f"is {targets!r}; it must list module names"
    return None


def read_peft_folder(path: str | Path) -> PeftFolder:
    path = Path(path)
    config_file = path / ADAPTER_CONFIG_NAME
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFConversionError(f"{config_file}: cannot be read as JSON ({err}); restore the adapter folder") from None
    if not isinstance(config, dict):
        raise HFConversionError(f"{config_file}: holds a {type(config).__name__}, not PEFT's LoraConfig")
    problem = _config_problem(config)
    if problem:
        raise HFConversionError(f"{config_file}: {problem[0]} {problem[1]}")
    targets = config["target_modules"]
    # PEFT writes the full module paths it adapted ('model.layers.0.self_attn.q_proj') when asked for all-linear
    names = targets if isinstance(targets, str) else sorted({name.rsplit(".", 1)[-1] for name in targets})
    settings = {"lora_rank": config["r"], "lora_alpha": float(config["lora_alpha"]),
                "lora_dropout": float(config.get("lora_dropout", 0.0)), "lora_target_modules": names,
                "lora_use_rslora": bool(config.get("use_rslora", False))}
    return PeftFolder(path, settings, config.get("base_model_name_or_path"))


def check_run_lora(folder: PeftFolder, lora: LoraSettings | None, source_of) -> None:
    """HFConversionError naming the setting, its file and the folder's key when the run's LoRA is not the folder's."""
    if lora is None:
        raise HFConversionError(f"{source_of('lora_rank')}: lora_rank is 0, but `load` {folder.path} is a PEFT LoRA "
                                "adapter folder; leave lora_rank unset to take the folder's LoRA settings")
    try:
        theirs = folder.lora(lora.gpt_neox)
    except ModelConfigError as err:
        raise HFConversionError(f"{folder.config_file}: target_modules: {err}") from None
    pairs = (("lora_rank", "r", lora.rank, theirs.rank), ("lora_alpha", "lora_alpha", lora.alpha, theirs.alpha),
             ("lora_dropout", "lora_dropout", lora.dropout, theirs.dropout),
             ("lora_target_modules", "target_modules", lora.target_modules, theirs.target_modules),
             ("lora_use_rslora", "use_rslora", lora.use_rslora, theirs.use_rslora))
    for setting, key, ours, folder_value in pairs:
        if ours != folder_value:
            shown = list(ours) if isinstance(ours, tuple) else ours
            raise HFConversionError(
                f"{source_of(setting)}: {setting} is {shown!r}, but {folder.config_file} says {key} "
                f"{list(folder_value) if isinstance(folder_value, tuple) else folder_value!r}; leave {setting} unset "
                "to take the folder's value")


def read_adapters(folder: PeftFolder, lora: LoraSettings, family: str, num_layers: int,
                  module_shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The folder's adapters under our names, fp32, verified: exactly the keys ``lora`` has, each shaped for
    its HF module (``module_shapes``: HF weight name -> shape of the base) and finite."""
    names = {peft: ours for ours, peft in peft_names(lora, family, num_layers).items()}
    source = folder.weights_file
    try:
        with safe_open(str(source), framework="pt") as handle:
            keys = list(handle.keys())
            missing = [key for key in names if key not in keys]
            unexpected = [key for key in keys if key not in names]
            if missing or unexpected:
                key, what = (missing[0], "is missing") if missing else (unexpected[0], "is no adapter of the run's LoRA")
                raise HFConversionError(f"{source}: {key} {what} ({len(missing)} missing, {len(unexpected)} "
                                        f"unexpected keys for target_modules {', '.join(lora.target_modules)} over "
                                        f"{num_layers} layers); the folder does not hold these adapters")
            adapters = {}
            for key in keys:
                tensor = handle.get_tensor(key)
                module, side = _module_and_side(key)
                out_features, in_features = module_shapes[f"{module}.weight"]
                shape = (lora.rank, in_features) if side == "A" else (out_features, lora.rank)
                if tuple(tensor.shape) != shape:
                    raise HFConversionError(f"{source}: {key} has shape {tuple(tensor.shape)}, the base's module and "
                                            f"r {lora.rank} give {shape}; the adapter is not for this base model")
                if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
                    raise HFConversionError(f"{source}: {key} holds values that are not finite floating-point "
                                            f"numbers ({tensor.dtype}); the adapter is damaged: export it again")
                adapters[names[key]] = tensor.float()
    except (OSError, SafetensorError) as err:
        raise HFConversionError(f"{source}: cannot be read as safetensors ({err}); restore the adapter folder") from None
    return adapters

