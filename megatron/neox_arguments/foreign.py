"""GPT-NeoX settings this framework does not have as settings of its own.

Three kinds:
- aliases: another GPT-NeoX name for one of our settings (renamed on load);
- inert: tunes GPU kernels, memory or cluster plumbing we do not have; accepted with a notice;
- unsupported: would change the model or training in a way we do not implement; an error,
  unless the value given is the one that switches the feature off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.neox_arguments.errors import ConfigError

ALIASES: dict[str, str] = {
    "gas": "gradient_accumulation_steps",
    "batch_size": "train_micro_batch_size_per_gpu",
    "clip_grad": "gradient_clipping",
}

# GPT-NeoX spellings of values that mean the same as one of our allowed values
VALUE_ALIASES: dict[str, dict[Any, Any]] = {
    "precision": {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"},
}

_KERNEL = "a GPU kernel choice; the model computes the same function without it"
_MEMORY = "a GPU memory/recomputation tuning knob we do not implement (use checkpoint_activations)"
_PLUMBING = "cluster/launcher plumbing this framework does not use"

INERT: dict[str, str] = {
    "scaled_upper_triang_masked_softmax_fusion": _KERNEL,
    "scaled_masked_softmax_fusion": _KERNEL,
    "bias_gelu_fusion": _KERNEL,
    "bias_dropout_fusion": _KERNEL,
    "rope_fusion": _KERNEL,
    "use_flashattn_swiglu": _KERNEL,
    "use_flash_attention": _KERNEL,
    "fp16_lm_cross_entropy": _KERNEL,
    "attention_softmax_in_fp32": _KERNEL,
    "apply_query_key_layer_scaling": _KERNEL,
    "partition_activations": _MEMORY,
    "synchronize_each_layer": _MEMORY,
    "checkpoint_num_layers": _MEMORY,
    "checkpoint_in_cpu": _MEMORY,
    "contiguous_checkpointing": _MEMORY,
    "profile_backward": _MEMORY,
    "deepspeed_activation_checkpointing": _MEMORY,
    "use_cpu_initialization": _MEMORY,
    "mmap_warmup": _MEMORY,
    "output_layer_parallelism": "only matters for tensor parallelism, which is fixed at 1",
    "sequence_parallel": "only matters for tensor parallelism, which is fixed at 1",
    "pipe_partition_method": "only matters for pipeline parallelism, which is not supported",
    "distributed_backend": "the backend is chosen by DeepSpeed's accelerator (nccl on GPU, gloo on CPU)",
    "fp32_allreduce": _PLUMBING,
    "detect_nvlink_pairs": _PLUMBING,
    "force_multi": _PLUMBING,
    "no_ssh_check": _PLUMBING,
    "comment": _PLUMBING,
    "use_shared_fs": _PLUMBING,
    "wall_clock_breakdown": "DeepSpeed's timing breakdown is always off; the trainer logs its own timings",
    "wandb_host": "W&B uses its own environment (WANDB_BASE_URL)",
    "wandb_team": "W&B uses its own environment (WANDB_ENTITY)",
    "git_hash": "recorded by GPT-NeoX itself, not a setting",
}


def _falsy(value: Any) -> bool:
    return not value


def _at_most_one(value: Any) -> bool:
    return value is None or value <= 1


def _disabled_dict(value: Any) -> bool:
    return not value or (isinstance(value, dict) and not value.get("enabled", False))


def _equals(off_value: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value == off_value


# name -> (is the value the one that switches the feature off?, what to tell the user)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "sparsity_config": (_falsy, "sparse attention is not supported; remove sparsity_config"),
    "moe_num_experts": (_at_most_one, "mixture-of-experts is not supported; use moe_num_experts: 1"),
    "num_experts": (_at_most_one, "mixture-of-experts is not supported; use 1 expert"),
    "use_mup": (_falsy, "muP is not supported; remove use_mup"),
    "num_unique_layers": (_falsy, "layer sharing is not supported; remove num_unique_layers"),
    "soft_prompt_tuning": (_disabled_dict, "soft prompt tuning is not supported"),
    "opt_pos_emb_offset": (_falsy, "OPT's position-embedding offset is not supported"),
    "use_bnb_optimizer": (_falsy, "bitsandbytes optimizers are not supported; use optimizer.type Adam/AdamW/SGD"),
    "curriculum_learning": (_disabled_dict, "curriculum learning is not supported"),
    "train_impl": (_equals("normal"), "only normal language-model training is supported (no DPO/KTO/RM)"),
    "mlp_type": (_equals("regular"), "for Llama's gated MLP write `activation: swiglu` instead of mlp_type"),
    "gpt_j_tied": (_falsy, "tied parallel-residual norms are not supported (gpt_j_residual with two norms is)"),
    "checkpoint_scale": (_equals("linear"), "only linear checkpoint spacing is supported (checkpoint_factor)"),
    "extra_save_iters": (_falsy, "extra save iterations are not supported; use checkpoint_factor"),
    "scheduler": (_falsy, "the trainer steps the learning rate itself; use lr_decay_style, warmup, min_lr"),
    "amp": (_disabled_dict, "apex AMP is not supported; use fp16 or bf16"),
    "load_universal": (_falsy, "universal checkpoints are not supported yet"),
}

ATTENTION_TYPES_WITH_GLOBAL_MATH = ("global", "flash")


def attention_config_problem(value: Any) -> str | None:
    """None when every layer uses plain global attention (flash is the same math, another kernel)."""
    if value is None:
        return None
    shape_hint = 'expected a list of [[attention types], layer count] pairs, e.g. [[["global"], 12]]'
    if not isinstance(value, list):
        return shape_hint
    for entry in value:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)):
            return shape_hint
        others = [kind for kind in entry[0] if kind not in ATTENTION_TYPES_WITH_GLOBAL_MATH]
        if others:
            return f"attention types {others} are not supported; only global attention is (e.g. [[[\"global\"], N]])"
    return None


def _hashable(value: Any) -> bool:
    return not isinstance(value, (dict, list))


def canonical_names(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Rename GPT-NeoX aliases to our names; an alias and its target in one source is an error."""
    renamed: dict[str, Any] = {}
    for name, value in values.items():
        target = ALIASES.get(name, name)
        if target in renamed:
            raise ConfigError(f"{source}: {name}: same setting as {target!r}, which is also set here; keep one")
        renamed[target] = VALUE_ALIASES.get(target, {}).get(value, value) if _hashable(value) else value
    return renamed


def take_foreign_settings(values: dict[str, Any], sources: dict[str, str]) -> list[str]:
    """Remove inert and switched-off GPT-NeoX settings from `values`; return one notice per setting.

    Raises ConfigError for settings that would change the model or training in an unsupported way.
    """
    notices = []
    for name in list(values):
        value = values[name]
        source = sources.get(name, "<dict>")
        if name == "attention_config":
            problem = attention_config_problem(value)
            if problem:
                raise ConfigError(f"{source}: attention_config: {problem}")
            reason = "standard global attention is what the model always computes"
        elif name in INERT:
            reason = INERT[name]
        elif name.startswith("moe_") and name not in UNSUPPORTED:
            reason = "only matters with moe_num_experts > 1, which is not supported"
        elif name in UNSUPPORTED:
            is_off, message = UNSUPPORTED[name]
            if not is_off(value):
                raise ConfigError(f"{source}: {name}: {value!r}: {message}")
            reason = "the feature it configures is off"
        else:
            continue
        notices.append(f"notice: {source}: {name} has no effect here ({reason})")
        del values[name]
    return notices
