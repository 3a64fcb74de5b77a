"""The DeepSpeed config, built from the same validated settings the trainer reads.

No DeepSpeed scheduler: the trainer steps the learning rate itself. `deepspeed_extra_args` is
deep-merged on top; it may add keys but not change one the settings already decide.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.schema import SETTINGS_LIST

# DeepSpeed keys decided by our settings; changing them through deepspeed_extra_args would let the
# trainer and DeepSpeed disagree.
OWNED_KEYS = {
    "train_batch_size": "train_batch_size",
    "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "optimizer": "optimizer",
    "scheduler": "lr_decay_style / warmup / min_lr (the trainer steps the LR itself)",
    "fp16": "fp16 / precision",
    "bf16": "bf16 / precision",
    "zero_optimization": "zero_optimization",
    "gradient_clipping": "gradient_clipping",
}
# settings that are DeepSpeed config keys of the same name; like GPT-NeoX, only non-defaults are written
PASSED_TO_DEEPSPEED = tuple(setting for setting in SETTINGS_LIST if setting.group == "deepspeed")


def build_deepspeed_config(settings: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_batch_size": settings["train_batch_size"],
        "train_micro_batch_size_per_gpu": settings["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": settings["gradient_accumulation_steps"],
        "optimizer": copy.deepcopy(settings["optimizer"]),
        "zero_optimization": copy.deepcopy(settings["zero_optimization"]),
        "gradient_clipping": settings["gradient_clipping"],
        "steps_per_print": settings["steps_per_print"],
        "wall_clock_breakdown": False,
    }
    for precision in ("fp16", "bf16"):
        if settings["precision"] == precision:
            config[precision] = copy.deepcopy(settings[precision])
    for setting in PASSED_TO_DEEPSPEED:
        if settings[setting.name] != setting.default:
            config[setting.name] = copy.deepcopy(settings[setting.name])
    if (settings["moe_num_experts"] or 1) > 1 and (settings["pipe_parallel_size"] or 0) > 1:
        # the router statistics travel between stages after the hidden states and need a gradient back;
        # DeepSpeed's partitioned sends split only the first tensor over the tensor-parallel ranks and
        # assert that nothing after it needs one
        config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if settings["fp32_allreduce"]:
        # GPT-NeoX's DeepSpeed had an fp32_allreduce key; today's DeepSpeed says it this way
        if settings["communication_data_type"] not in (None, "fp32"):
            raise ConfigError(f"fp32_allreduce: true but communication_data_type is "
                              f"{settings['communication_data_type']!r}; set one of them")
        config["communication_data_type"] = "fp32"
    _merge_extra(config, settings["deepspeed_extra_args"] or {}, path=())
    return config


def build_inference_deepspeed_config(settings: dict[str, Any], partitioned: bool = False) -> dict[str, Any]:
    """The DeepSpeed config of a model that only runs forward (generate.py, DPO/KTO's reference): the run's
    precision, no optimizer; no ZeRO (every tensor-parallel rank holds its whole shard), or with `partitioned`
    the run's ZeRO-3 section, so the model's parameters are split over the data-parallel group as the policy's."""
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                              "steps_per_print": settings["steps_per_print"], "wall_clock_breakdown": False}
    if settings["precision"] in ("fp16", "bf16"):
        config[settings["precision"]] = {"enabled": True}
    if partitioned:
        config["zero_optimization"] = copy.deepcopy(settings["zero_optimization"])
    return config


def _merge_extra(config: dict[str, Any], extra: dict[str, Any], path: tuple[str, ...]) -> None:
    for key, value in extra.items():
        here = (*path, key)
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge_extra(config[key], value, here)
            continue
        owner = OWNED_KEYS.get(here[0])
        adds_owned_section = not path and key not in config
        changes_value = key in config and config[key] != value
        # a DeepSpeed key that is also one of our settings: extra args may set it only where the setting did not
        if owner is None and changes_value and any(setting.name == here[0] for setting in PASSED_TO_DEEPSPEED):
            owner = here[0]
        if owner is not None and (adds_owned_section or changes_value):
            raise ConfigError(
                f"deepspeed_extra_args: {'.'.join(here)} = {value!r} would override what the settings decide "
                f"({config.get(key)!r}); set it through {owner} instead"
            )
        config[key] = copy.deepcopy(value)
