"""PEFT adapter folders: LoRA adapters of ours written as PEFT saves them, and read back to start a run.

A folder holds ``adapter_config.json`` (PEFT's LoraConfig) and ``adapter_model.safetensors``, whose keys
are the PEFT model's parameter names without the adapter's name: ``base_model.model.`` + the HF module
(``model.layers.0.self_attn.q_proj``, ``gpt_neox.layers.0.attention.query_key_value``) + ``.lora_A.weight``
or ``.lora_B.weight``. Each of our adapters is one HF module's (megatron/model/lora.py), so the tensors
are ours as they are, under another name.

Adapters of expert parameters are PEFT's ``target_parameters`` (listed there, not in target_modules): one
wrapper per parameter around the layer's ``mlp.experts`` module, so their keys are that module's; with both
parameters adapted PEFT wraps ``gate_up_proj`` (declared first) first, and its wrapper, now inside
``down_proj``'s, is under ``.base_layer``. PEFT holds every expert's pair in one A [experts x r, in], expert by
expert as ours, and one B [out, r x experts] whose column ``i x experts + e`` is column i of expert e's B (ours
is [experts x out, r]): B is rearranged on the way out and in. Only safetensors and json are read or written: a folder loads
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

from megatron.contract.architecture import Architecture, ModelConfigError
from megatron.contract.lora_settings import (
    ALL_LINEAR,
    LoraSettings,
    adapter_key,
    expert_target_of,
    target_modules_of,
    target_shapes,
)
from megatron.hf.errors import HFConversionError
from megatron.hf.io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, is_hf_model_dir
from megatron.hf.mapping import hf_linear_module
from megatron.model.gpt_model import layer_key

_PEFT_PREFIX = "base_model.model."
SIDES = ("A", "B")
# PEFT options that change what an adapter computes, each with the value of a plain LoRA adapter
_PLAIN_LORA = {"use_dora": False, "bias": "none", "fan_in_fan_out": False, "lora_bias": False,
               "modules_to_save": None, "layers_to_transform": None, "layer_replication": None,
               "rank_pattern": {}, "alpha_pattern": {}, "trainable_token_indices": None}


def peft_names(lora: LoraSettings, family: str, num_layers: int, expert_layers: range | list[int] = ()) -> dict[str, str]:
    """Our name of each adapter weight -> its key in a PEFT folder of the HF model ``family``; expert targets
    adapt the layers ``expert_layers``."""
    if lora.gpt_neox != (family == "gpt_neox"):
        raise HFConversionError(f"LoRA targets {', '.join(lora.target_modules)} are not module names of Hugging "
                                f"Face {family}; export the model with the family its architecture implies")
    names = {}
    for layer in range(num_layers):
        for module, target in lora.targets().items():
            if target.experts and layer not in expert_layers:
                continue
            hf_module = hf_linear_module(family, layer, module)
            if module == "experts.gate_up_proj" and "experts.down_proj" in lora.target_modules:
                hf_module += ".base_layer"  # inside down_proj's wrapper (module docstring)
            for side in SIDES:
                ours = f"sequential.{layer_key(layer)}.{target.linear}.lora.{adapter_key(module)}.lora_{side}"
                names[ours] = f"{_PEFT_PREFIX}{hf_module}.lora_{side}.weight"
    return names


def expert_layers(arch: Architecture) -> list[int]:
    return [layer for layer in range(arch.num_layers) if arch.has_experts(layer)]


def _is_expert_b(ours: str) -> bool:
    return ".experts.mlp.lora." in ours and ours.endswith(".lora_B")


def peft_layout(ours: str, tensor: torch.Tensor, experts: int) -> torch.Tensor:
    """Our adapter weight ``ours`` as PEFT holds it (an expert parameter's B rearranged: module docstring)."""
    if not _is_expert_b(ours):
        return tensor
    rank = tensor.shape[1]
    return tensor.view(experts, -1, rank).permute(1, 2, 0).reshape(-1, rank * experts)


def our_layout(ours: str, tensor: torch.Tensor, experts: int) -> torch.Tensor:
    """``peft_layout``'s inverse."""
    if not _is_expert_b(ours):
        return tensor
    rank = tensor.shape[1] // experts
    return tensor.view(-1, rank, experts).permute(2, 0, 1).reshape(-1, rank)


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
    experts = [name for name, target in lora.targets().items() if target.experts]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": int(lora.alpha) if lora.alpha.is_integer() else lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": [name for name in lora.target_modules if name not in experts],
            "target_parameters": experts or None, "use_rslora": lora.use_rslora,
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

    def lora(self, gpt_neox: bool, experts: bool = False) -> LoraSettings:
        """The adapters' LoRA on a model of GPT-NeoX's family (else Llama's), with ``experts`` or without;
        ModelConfigError for a target module that model lacks."""
        values = self.settings
        return LoraSettings(values["lora_rank"], values["lora_alpha"], values["lora_dropout"],
                            target_modules_of(values["lora_target_modules"], gpt_neox, experts),
                            values["lora_use_rslora"], gpt_neox, experts)


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
    parameters = config.get("target_parameters") or []
    if not (isinstance(parameters, list) and all(isinstance(p, str) and expert_target_of(p) for p in parameters)):
        return "target_parameters", (f"is {parameters!r}; only the experts' gate_up_proj and down_proj (transformers' "
                                     "fused expert parameters) load here")
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        return "target_modules", f"is the pattern {targets!r}; list the module names instead (q_proj, ...)"
    if not isinstance(targets, str) and not (isinstance(targets, list) and (targets or parameters)
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
    experts = [expert_target_of(name) for name in config.get("target_parameters") or []]
    if experts:
        names = [*([names] if isinstance(names, str) else names), *dict.fromkeys(experts)]
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
        theirs = folder.lora(lora.gpt_neox, lora.experts)
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


def _expected_shape(key: str, ours: str, lora: LoraSettings, arch: Architecture,
                    module_shapes: dict[str, torch.Size]) -> tuple[int, int]:
    """The shape PEFT gives adapter weight ``key`` (ours ``ours``) over this base."""
    module, side = _module_and_side(key)
    experts = 1
    if ".experts.mlp.lora." in ours:  # one expert's slice of the parameter, PEFT's pairs of every expert together
        experts = arch.moe_num_experts
        shapes = target_shapes(arch.hidden_size, 1, 1, 1, 1, arch.moe_intermediate_size)
        out_features, in_features = shapes[f"experts.{ours.split('.')[-2]}"]
    else:
        out_features, in_features = module_shapes[f"{module}.weight"]
    return (experts * lora.rank, in_features) if side == "A" else (out_features, lora.rank * experts)


def read_adapters(folder: PeftFolder, lora: LoraSettings, family: str, arch: Architecture,
                  module_shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The folder's adapters under our names and in our layout, fp32, verified: exactly the keys ``lora`` has,
    each shaped for its HF module (``module_shapes``: HF weight name -> shape of the base) and finite."""
    names = {peft: ours for ours, peft in peft_names(lora, family, arch.num_layers, expert_layers(arch)).items()}
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
                                        f"{arch.num_layers} layers); the folder does not hold these adapters")
            adapters = {}
            for key in keys:
                tensor = handle.get_tensor(key)
                shape = _expected_shape(key, names[key], lora, arch, module_shapes)
                if tuple(tensor.shape) != shape:
                    raise HFConversionError(f"{source}: {key} has shape {tuple(tensor.shape)}, the base's module and "
                                            f"r {lora.rank} give {shape}; the adapter is not for this base model")
                if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
                    raise HFConversionError(f"{source}: {key} holds values that are not finite floating-point "
                                            f"numbers ({tensor.dtype}); the adapter is damaged: export it again")
                adapters[names[key]] = our_layout(names[key], tensor.float(), arch.moe_num_experts)
    except (OSError, SafetensorError) as err:
        raise HFConversionError(f"{source}: cannot be read as safetensors ({err}); restore the adapter folder") from None
    return adapters
