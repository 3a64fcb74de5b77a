"""GPT-NeoX settings this framework does not have as settings of its own.

Four kinds:
- aliases: another GPT-NeoX name for one of our settings (renamed on load);
- inert: tunes GPU kernels, memory or cluster plumbing we do not have; accepted with a notice;
- unsupported: would change the model or training in a way we do not implement; an error,
  unless the value given is the one that switches the feature off;
- tensor-parallel only: matters only at a tensor-parallel size above 1, where a value other than
  the one built here is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.numbers import as_number

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
_GENERATION = "a generation extra generate.py does not have (returned logits)"
_SET_BY_GPT_NEOX = "filled in by GPT-NeoX itself at launch, not a setting"


def _only_with(feature: str) -> str:
    return f"only matters with {feature}, which is off"


INERT: dict[str, str] = {
    "scaled_upper_triang_masked_softmax_fusion": _KERNEL,
    "scaled_masked_softmax_fusion": _KERNEL,
    "bias_dropout_fusion": _KERNEL,
    "rope_fusion": _KERNEL,
    "layernorm_fusion": _KERNEL,
    "rmsnorm_fusion": _KERNEL,
    "use_flashattn_swiglu": _KERNEL,
    "use_flash_attention": _KERNEL,
    "fp16_lm_cross_entropy": _KERNEL,
    "attention_softmax_in_fp32": _KERNEL,
    "apply_query_key_layer_scaling": _KERNEL,
    "fused_kernels_build_path": _KERNEL,
    "mamba_selective_scan_fusion": _KERNEL,
    "mamba_causal_conv_fusion": _KERNEL,
    "mamba_inner_func_fusion": _KERNEL,
    "partition_activations": _MEMORY,
    "synchronize_each_layer": _MEMORY,
    "checkpoint_num_layers": _MEMORY,
    "checkpoint_in_cpu": _MEMORY,
    "contiguous_checkpointing": _MEMORY,
    "profile_backward": _MEMORY,
    "deepspeed_activation_checkpointing": _MEMORY,
    "activation_checkpointing": _MEMORY,
    "use_cpu_initialization": _MEMORY,
    "mmap_warmup": _MEMORY,
    "distributed_backend": "the backend is chosen by DeepSpeed's accelerator (nccl on GPU, gloo on CPU)",
    "rotary_save_freqs_buffer": "only decides whether GPT-NeoX stores the rotary frequencies in checkpoints; they are recomputed here",
    "detect_nvlink_pairs": _PLUMBING,
    "force_multi": _PLUMBING,
    "no_ssh_check": _PLUMBING,
    "comment": _PLUMBING,
    "account": _PLUMBING,
    "use_shared_fs": _PLUMBING,
    "deepspeed": "training always runs on DeepSpeed",
    "deepscale": "a deprecated GPT-NeoX flag without effect",
    "deepscale_config": "a deprecated GPT-NeoX flag without effect",
    "wall_clock_breakdown": "DeepSpeed's timing breakdown is always off; the trainer logs its own timings",
    "wandb_host": "W&B uses its own environment (WANDB_BASE_URL)",
    "wandb_team": "W&B uses its own environment (WANDB_ENTITY)",
    "wandb_init_all_ranks": "W&B logs from rank 0, which sees every logged value",
    "peak_theoretical_tflops": "model FLOPs utilisation is not logged",
    "git_hash": _SET_BY_GPT_NEOX,
    "world_size": _SET_BY_GPT_NEOX,
    "local_rank": _SET_BY_GPT_NEOX,
    "rank": _SET_BY_GPT_NEOX,
    "user_script": _SET_BY_GPT_NEOX,
    "is_pipe_parallel": _SET_BY_GPT_NEOX,
    "do_train": _SET_BY_GPT_NEOX,
    "do_valid": _SET_BY_GPT_NEOX,
    "do_test": _SET_BY_GPT_NEOX,
    "optimizer_type": "GPT-NeoX derives it from optimizer.type",
    "hysteresis": "DeepSpeed reads loss scaling from the fp16 section",
    "dynamic_loss_scale": "DeepSpeed reads loss scaling from the fp16 section",
    "loss_scale": "DeepSpeed reads loss scaling from the fp16 section",
    "loss_scale_window": "DeepSpeed reads loss scaling from the fp16 section",
    "min_scale": "DeepSpeed reads loss scaling from the fp16 section",
    "short_seq_prob": "used only by BERT-style data, not GPT training",
    "s3_chunk_size": _only_with("s3_path"),
    "weighted_sampler_alpha": _only_with("weight_by_num_documents"),
    "param_sharing_style": _only_with("num_unique_layers"),
    "gmlp_attn_dim": _only_with("gMLP attention"),
    "rpe_num_buckets": _only_with("pos_emb: rpe"),
    "rpe_max_distance": _only_with("pos_emb: rpe"),
    "scalenorm_epsilon": _only_with("norm: scalenorm"),
    "curriculum_seqlen": _only_with("curriculum_learning"),
    "gradient_noise_scale_n_batches": _only_with("log_gradient_noise_scale"),
    "gradient_noise_scale_cpu_offload": _only_with("log_gradient_noise_scale"),
    "adlr_autoresume_interval": _only_with("adlr_autoresume"),
    "weight_server_port": _only_with("serve_model_weights"),
    "lazy_mpu_init": "only matters when GPT-NeoX is embedded in another program",
    "moe_lbl_in_fp32": "GPT-NeoX computes no load-balancing loss; moe_load_balancing_loss adds Hugging Face's, "
                       "whose sums are in fp32",
}
INERT.update(dict.fromkeys(
    ("return_logits",),
    _GENERATION,
))
_SUBORDINATE: dict[str, tuple[str, ...]] = {
    "Transformer Engine": ("te_fp8_format", "te_fp8_wgrad", "te_fp8_amax_history_len", "te_fp8_amax_compute_algo",
                           "te_fp8_margin"),
    "use_mup": ("mup_init_scale", "mup_attn_temp", "mup_output_temp", "mup_embedding_mult", "mup_rp_embedding_mult",
                "mup_width_scale"),
    "use_comet": ("comet_workspace", "comet_project", "comet_experiment_name", "comet_tags", "comet_others",
                  "comet_experiment"),
    "Mamba blocks (attention_config: mamba)": ("mamba_selective_fp32_params", "mamba_use_bias_in_conv",
                                                "mamba_use_bias_in_linears"),
}
for _feature, _names in _SUBORDINATE.items():
    INERT.update(dict.fromkeys(_names, _only_with(_feature)))


@dataclass(frozen=True)
class OffWhen:
    """Which values of a GPT-NeoX setting leave its feature off (or select what is built here)."""

    test: Callable[[Any], bool]
    values: str  # those values, in words

    def __call__(self, value: Any) -> bool:
        return self.test(value)


_falsy = OffWhen(lambda value: not value, "unset, false, 0 or empty")
_at_most_one = OffWhen(lambda value: value is None or value <= 1, "unset or at most 1")
_disabled_dict = OffWhen(lambda value: not value or (isinstance(value, dict) and not value.get("enabled", False)),
                         "unset, empty or {enabled: false}")


def _equals(off_value: Any) -> OffWhen:
    return OffWhen(lambda value: value is None or value == off_value, f"unset or {off_value}")


def _not_built(feature: str, instead: str = "") -> str:
    return f"{feature} is a GPT-NeoX feature not built here" + (f"; {instead}" if instead else "")


# name -> (is the value the one that switches the feature off?, what to tell the user)
UNSUPPORTED: dict[str, tuple[OffWhen, str]] = {
    "sparsity_config": (_falsy, _not_built("sparse attention", "remove sparsity_config")),
    "num_experts": (_at_most_one, "GPT-NeoX's num_experts configures DeepSpeed-MoE's experts, which are not built "
                                  "here; experts are built with moe_num_experts (and moe_top_k, moe_router_type...): "
                                  "write moe_num_experts instead of num_experts"),
    "use_mup": (_falsy, _not_built("muP", "remove use_mup")),
    "coord_check": (_falsy, _not_built("muP's coordinate check")),
    "save_base_shapes": (_falsy, _not_built("muP's base shapes")),
    "base_shapes_file": (_falsy, _not_built("muP's base shapes")),
    "num_unique_layers": (_falsy, _not_built("layer sharing", "remove num_unique_layers")),
    "soft_prompt_tuning": (_disabled_dict, _not_built("soft prompt tuning")),
    "opt_pos_emb_offset": (_falsy, _not_built("OPT's position-embedding offset")),
    "use_qk_layernorm": (_falsy, "GPT-NeoX's use_qk_layernorm (one norm shared by queries and keys over all heads of a "
                                 "tensor-parallel rank) is not built here; qk_layernorm normalises each head's query "
                                 "and key with weights of their own, as megatron-core and Qwen3 do"),
    "use_bnb_optimizer": (_falsy, _not_built("bitsandbytes optimizers", "use optimizer.type Adam/AdamW/SGD")),
    "curriculum_learning": (_disabled_dict, _not_built("curriculum learning")),
    "mlp_type": (_equals("regular"), "for Llama's gated MLP write `activation: swiglu` instead of mlp_type"),
    "gpt_j_tied": (_falsy, "tied parallel-residual norms are not supported (gpt_j_residual with two norms is)"),
    "checkpoint_scale": (_equals("linear"), "only linear checkpoint spacing is supported (checkpoint_factor, extra_save_iters)"),
    "scheduler": (_falsy, "the trainer steps the learning rate itself; use lr_decay_style, warmup, min_lr"),
    "amp": (_disabled_dict, _not_built("apex AMP", "use fp16 or bf16")),
    "load_universal": (_falsy, "a top-level load_universal is not read; DeepSpeed reads it from its checkpoint section: "
                               "set deepspeed_extra_args: {checkpoint: {load_universal: true}}"),
    "te_columnparallel": (_falsy, _not_built("Transformer Engine")),
    "te_rowparallel": (_falsy, _not_built("Transformer Engine")),
    "te_layernorm_mlp": (_falsy, _not_built("Transformer Engine")),
    "te_mha": (_falsy, _not_built("Transformer Engine")),
    "te_fp8_mha": (_falsy, _not_built("Transformer Engine")),
    "dim_att": (_falsy, _not_built("RWKV")),
    "head_size": (_falsy, _not_built("RWKV")),
    "ffn_dim": (_falsy, _not_built("RWKV")),
    "use_comet": (_falsy, _not_built("Comet logging", "use tensorboard_dir or use_wandb")),
    "log_grad_pct_zeros": (_falsy, _not_built("logging the share of zero gradients")),
    "log_optimizer_states": (_falsy, _not_built("logging optimizer-state norms")),
    "log_gradient_noise_scale": (_falsy, _not_built("the gradient noise scale logger")),
    "serve_model_weights": (_falsy, _not_built("serving the weights to synth-vllm over CUDA IPC", "set "
                                               "serve_model_weights: false; the rollouts are sampled here "
                                               "(reward_function or reward_model) or come from the data server "
                                               "(online_dataserver_ips/ports)")),
    "s3_path": (_falsy, _not_built("uploading checkpoints to S3")),
    "no_save_rng": (_falsy, _not_built("saving checkpoints without RNG states")),
    "exit_interval": (_falsy, _not_built("exit_interval", "set train_iters")),
    "char_level_ppl": (_falsy, _not_built("character-level perplexity")),
    "adlr_autoresume": (_falsy, _not_built("ADLR autoresume")),
    "weight_by_num_documents": (_falsy, _not_built("weighting datasets by document count", "set train_data_weights")),
    "train_epochs": (_falsy, _not_built("train_epochs", "set train_iters")),
    "autotuning": (_falsy, _not_built("DeepSpeed autotuning through deepy.py")),
    "elasticity": (_disabled_dict, _not_built("DeepSpeed elastic training")),
    "compression_training": (_falsy, _not_built("DeepSpeed compression training")),
    "data_efficiency": (_disabled_dict, _not_built("DeepSpeed data efficiency (curriculum, random-LTD)")),
    "sparse_attention": (_falsy, _not_built("DeepSpeed sparse attention")),
    "checkpoint": (_falsy, "DeepSpeed's checkpoint section would change how checkpoints are written; remove it"),
    "tensorboard": (_disabled_dict, "DeepSpeed's own TensorBoard monitor is not used; set tensorboard_dir"),
    "wandb": (_disabled_dict, "DeepSpeed's own W&B monitor is not used; set use_wandb"),
    "autotuning_run": (_falsy, _not_built("DeepSpeed autotuning through deepy.py")),
}


@dataclass(frozen=True)
class TensorParallelOnly:
    """A GPT-NeoX setting that changes nothing at model_parallel_size 1, and at a larger size is built here
    with one value only."""

    is_built: OffWhen  # is the value the one this framework builds?
    built: str  # what this framework builds, for the notice
    other: str  # what another value asks for, which is not built here
    instead: str  # what a run should set instead
    # does another value lay out the saved weights otherwise? (then a checkpoint's settings are refused too)
    shapes_weights: bool


TENSOR_PARALLEL_ONLY: dict[str, TensorParallelOnly] = {
    "output_layer_parallelism": TensorParallelOnly(
        _equals("column"), "the output layer is always split over the vocabulary, GPT-NeoX's column",
        "an output layer split over the hidden dimension (row)",
        "set output_layer_parallelism: column, GPT-NeoX's default",
        shapes_weights=True),
}
_TENSOR_PARALLEL_SIZE_ONE = "only matters at a tensor-parallel size above 1, and model_parallel_size is 1"

# Values GPT-NeoX allows for one of our settings that select a feature not built here.
GPT_NEOX_ONLY_VALUES: dict[str, dict[Any, str]] = {
    "pos_emb": {"sinusoidal": "sinusoidal position embedding", "rpe": "T5 relative position encoding (rpe)",
                "alibi": "ALiBi position bias"},
    "norm": {"non_parametric_layernorm": "non-parametric LayerNorm", "scalenorm": "ScaleNorm",
             "te_rmsnorm": "Transformer Engine RMSNorm", "te_layernorm": "Transformer Engine LayerNorm"},
    "activation": {name: f"the {name} activation" for name in
                   ("geglu", "softsign", "swish", "mish", "reglu", "bilinear", "glu")},
    "init_method": {name: f"the {name} initialisation" for name in
                    ("orthogonal", "scaled_orthogonal", "xavier_uniform", "xavier_normal",
                     "single_residual_scaled_normal")},
    "data_impl": {"cached": "the legacy cached indexed-dataset format (preprocess into mmap .bin/.idx files)"},
    # Both fetch their vocabulary over the network while the run starts.
    "tokenizer_type": {"HFGPT2Tokenizer": "HFGPT2Tokenizer, which downloads GPT-2's tokenizer from the Hugging "
                                          "Face Hub (use GPT2BPETokenizer with GPT-2's vocab.json and merges.txt)",
                       "TiktokenTokenizer": "TiktokenTokenizer, which downloads its encoding when first used "
                                            "(use HFTokenizer or GPT2BPETokenizer with local files)"},
}
GPT_NEOX_ONLY_VALUES["output_layer_init_method"] = GPT_NEOX_ONLY_VALUES["init_method"]


def gpt_neox_only_value(name: str, value: Any) -> str | None:
    """The GPT-NeoX feature that `value` of setting `name` selects, when that feature is not built here."""
    return GPT_NEOX_ONLY_VALUES.get(name, {}).get(value) if _hashable(value) else None


ATTENTION_TYPES_WITH_GLOBAL_MATH = ("global", "flash")
# the notice for an attention_config of global (or flash) attention only
GLOBAL_ATTENTION = "standard global attention is what the model always computes"


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
            return (f"attention types {others} are GPT-NeoX features not built here (sparse/local attention, "
                    'gMLP, Mamba, RWKV); only global attention is (e.g. [[["global"], N]])')
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


def _tensor_parallel_size(values: dict[str, Any]) -> int:
    size = as_number(values.get("model_parallel_size"), int)
    return 1 if size is None else size


def take_foreign_settings(values: dict[str, Any], sources: dict[str, str], *, recorded_by_checkpoint: bool = False
                          ) -> list[str]:
    """Remove inert and switched-off GPT-NeoX settings from `values`; return one notice per setting.

    Raises ConfigError for settings that would change the model or training in an unsupported way.
    `recorded_by_checkpoint`: the settings a checkpoint was saved with, of which only what lays out its
    weights matters (how that run ran, such as sequence parallelism, does not).
    """
    notices = []
    for name in list(values):
        value = values[name]
        source = sources.get(name, "<dict>")
        if name == "attention_config":
            problem = attention_config_problem(value)
            if problem:
                raise ConfigError(f"{source}: attention_config: {problem}")
            reason = GLOBAL_ATTENTION
        elif name in INERT:
            reason = INERT[name]
        elif name in UNSUPPORTED:
            is_off, message = UNSUPPORTED[name]
            if not is_off(value):
                raise ConfigError(f"{source}: {name}: {value!r}: {message}")
            reason = "the feature it configures is off"
        elif name in TENSOR_PARALLEL_ONLY:
            rule = TENSOR_PARALLEL_ONLY[name]
            if _tensor_parallel_size(values) <= 1:
                reason = _TENSOR_PARALLEL_SIZE_ONE
            elif rule.is_built(value):
                reason = rule.built
            elif not recorded_by_checkpoint:
                raise ConfigError(f"{source}: {name}: {value!r}: {_not_built(rule.other, rule.instead)}")
            elif rule.shapes_weights:
                raise ConfigError(f"{source}: {name}: {value!r}: {_not_built(rule.other)}, and the checkpoint's "
                                  "weights are laid out for it")
            else:
                reason = "it only changed how the saving run ran, not its weights"
        else:
            continue
        notices.append(f"notice: {source}: {name} has no effect here ({reason})")
        del values[name]
    return notices
