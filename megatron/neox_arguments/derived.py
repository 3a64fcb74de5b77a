"""Settings computed from others, and the checks that need several settings at once.

Works on a plain dict holding every setting (defaults filled in) and the file each key came
from, so every error can name the file and key to fix.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

from megatron.contract.architecture import (
    ModelConfigError,
    built_intermediate_size,
    expert_width,
    gelu_approximation,
    gpt_neox_shaped,
    mixture_of_experts_problem,
    query_key_norm_problem,
    rope_scaling_of,
    tensor_parallel_split_problem,
)
from megatron.contract.lora_settings import target_modules_of, target_of, target_shapes
from megatron.neox_arguments.errors import ConfigError, where
from megatron.neox_arguments.numbers import INT64_MAX, deepspeed_sections
from megatron.neox_arguments.schema import SETTINGS
from megatron.neox_arguments.world import active_hosts, effective_hostfile
from megatron.optim.optimizer_layout import precision_of, zero_stage_of
from megatron.tokenizer.tokenizer import TOKENIZER_FILES

# The source of data_path/vocab_file/tokenizer_type when the run context points them at the embedded corpus.
EMBEDDED_CORPUS_SOURCE = "embedded_corpus (resolved)"
MODEL_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
RUN_REQUIRED = ("train_iters",)
# what GPT-NeoX trains with when neither optimizer.params.lr nor lr is given
GPT_NEOX_DEFAULT_LR = 0.001
OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
# the data order is drawn from numpy.random.RandomState(seed), which takes 0 .. 2**32 - 1
MAX_SEED = 2**32 - 1
# the GPT-NeoX fp16 dict carries its own on-switch, which DeepSpeed's fp16 section does not know
NEOX_ONLY_FP16_KEYS = ("fp16", "type")


def padded_vocab_size(orig_vocab_size: int, divisible_by: int, model_parallel_size: int) -> int:
    """The vocabulary padded so each tensor-parallel shard holds a multiple of `divisible_by` rows."""
    multiple = divisible_by * model_parallel_size
    return int(math.ceil(orig_vocab_size / multiple) * multiple)


def derive_all(v: dict[str, Any], sources: dict[str, str], require_run_settings: bool,
               notices: list[str] | None = None, require_model: bool = True) -> None:
    """Fill in derived settings of `v` in place; raise ConfigError on impossible combinations.

    What is accepted but worth a line to the user (a hostfile that is not there) goes to `notices`.

    Without `require_run_settings` (a model-only dict: library code, tests) the settings only a
    training run needs (train_iters, lr, batch sizes, data) may be missing; what is given is
    still checked and derived by the same rules. Without `require_model` (what a checkpoint of
    another program recorded) the model's shape may be missing too, and is then not derived.
    """
    model_given = all(v[name] is not None for name in MODEL_REQUIRED)
    required = (MODEL_REQUIRED if require_model else ()) + (RUN_REQUIRED if require_run_settings else ())
    for name in required:
        if v[name] is None and not v["load"] and (v["text_gen_type"] or v["eval_tasks"]):
            raise ConfigError(f"load: not set (nor {name}): generate.py and eval.py use a trained model; set `load` "
                              "to its checkpoint or Hugging Face folder, which gives the model's settings")
        if v[name] is None:
            raise ConfigError(f"{name}: required but not set in any config file; add `{name}: <value>`")
    _check_ranges(v, sources)
    _check_nothing_set_for_a_feature_that_is_off(v, sources)
    _derive_precision(v, sources)
    _derive_zero_stage(v, sources)
    _derive_optimizer(v, sources, require_run_settings)
    _check_zero_supports_the_optimizer(v, sources)
    _derive_world(v, sources, notices if notices is not None else [])
    _derive_batch(v, sources, require_run_settings)
    if model_given:
        _derive_model_shape(v, sources)
    _derive_schedule(v, sources)
    _derive_checkpointing(v, sources)
    _check_profiling(v, sources)
    _check_train_impl(v, sources)
    _check_pipeline(v, sources)
    _check_sequence_parallel(v, sources, notices if notices is not None else [])
    _check_context_parallel(v, sources)
    _check_mixture_of_experts(v, sources)
    _check_lora(v, sources)
    if require_run_settings:
        _check_data(v, sources)


def _fail(sources: dict[str, str], name: str, message: str) -> ConfigError:
    return ConfigError(f"{where(sources, name)}: {message}")


def _check_ranges(v: dict[str, Any], sources: dict[str, str]) -> None:
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters",
                "make_vocab_size_divisible_by", "mlp_multiple_of", "log_interval", "steps_per_print",
                "moe_num_experts")
    for name in positive:
        if v[name] is not None and v[name] < 1:
            raise _fail(sources, name, f"must be at least 1, got {v[name]}")
    for name in ("num_kv_heads", "intermediate_size", "max_position_embeddings", "lr_decay_iters",
                 "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                 "checkpoint_factor", "save_interval", "keep_last_n_checkpoints", "num_gpus"):
        if v[name] is not None and v[name] < 1:
            raise _fail(sources, name, f"must be at least 1 when set, got {v[name]}")
    if v["num_nodes"] is not None and v["num_nodes"] < 1 and v["num_nodes"] != -1:
        raise _fail(sources, "num_nodes", f"must be at least 1 (or -1: every host of the hostfile), got {v['num_nodes']}")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0 <= v[name] < 1:
            raise _fail(sources, name, f"must be in [0, 1), got {v[name]}")
    if not 0 < v["rotary_pct"] <= 1:
        raise _fail(sources, "rotary_pct", f"must be in (0, 1], got {v['rotary_pct']}")
    for name in ("warmup", "min_lr", "weight_decay", "gradient_clipping", "max_nonfinite_steps"):
        if v[name] < 0:
            raise _fail(sources, name, f"must not be negative, got {v[name]}")
    if v["sliding_window_width"] is not None and v["sliding_window_width"] < 1:
        raise _fail(sources, "sliding_window_width", f"must be at least 1 when set, got {v['sliding_window_width']}")
    if v["model_parallel_size"] < 1:
        raise _fail(sources, "model_parallel_size", f"must be at least 1, got {v['model_parallel_size']}")
    if v["pipe_parallel_size"] < 0:
        raise _fail(sources, "pipe_parallel_size", f"must not be negative, got {v['pipe_parallel_size']}")
    method = v["pipe_partition_method"]
    if method not in ("uniform", "parameters") and not (method.startswith("type:") and len(method) > 5):
        raise _fail(sources, "pipe_partition_method", f"{method!r} is not one of 'uniform', 'parameters' or "
                    "'type:<regex of layer class names>' (GPT-NeoX's default: 'type:transformer|mlp')")
    if v["eval_interval"] < 1 or v["eval_iters"] < 0:
        raise _fail(sources, "eval_interval", "eval_interval must be at least 1 and eval_iters not negative")
    if not 0 <= v["seed"] <= MAX_SEED:
        raise _fail(sources, "seed", f"must be between 0 and {MAX_SEED} (NumPy's seed range), got {v['seed']}")
    _check_objective_coefficients(v, sources)
    _check_generation_ranges(v, sources)


# A feature's on-switch, the value that turns it off, and the settings that only act while it is on. One of
# them set (to other than its default) while the switch is off would be accepted and do nothing: the run
# would silently be a full fine-tune, or dense.
FEATURE_SWITCHES = {
    "lora_rank": (0, "LoRA", ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_use_rslora"),
                  "set lora_rank to the adapters' rank (e.g. 8)"),
    "moe_num_experts": (1, "mixture of experts", (
        "moe_top_k", "moe_expert_interval", "moe_router_type", "moe_jitter_eps", "moe_intermediate_size",
        "moe_norm_topk_prob", "moe_shared_expert_intermediate_size", "moe_load_balancing_loss",
        "moe_load_balancing_loss_coef", "moe_collapse_token_share", "moe_collapse_steps"),
        "set moe_num_experts to the number of experts (2 or more)"),
}


def _check_nothing_set_for_a_feature_that_is_off(v: dict[str, Any], sources: dict[str, str]) -> None:
    for switch, (off, feature, dependents, turn_on) in FEATURE_SWITCHES.items():
        if v[switch] != off:
            continue
        given = [name for name in dependents if name in sources and v[name] != SETTINGS[name].default]
        if given:
            name = given[0]
            raise ConfigError(
                f"{where(sources, name)} is {v[name]!r}, but {where(sources, switch)} is {off}, which turns "
                f"{feature} off, so {name} would do nothing; {turn_on}, or remove {', '.join(given)}")


# Each objective's coefficients, by their definitions (megatron/objectives; TRL documents the same meanings):
# beta scales the implicit reward log(pi / pi_ref), so 0 makes the loss a constant and a negative beta
# rewards the rejected answer; KTO's class weights (lambda_D, lambda_U) weigh a loss term each; z_loss
# penalises large rewards, which a negative value would reward.
OBJECTIVE_COEFFICIENTS = {
    "dpo_beta": (lambda x: x > 0, "must be positive (DPO's beta scales the implicit reward beta * log(pi / pi_ref); "
                 "0 leaves nothing to learn, a negative value prefers the rejected answers); TRL's default is 0.1"),
    "kto_beta": (lambda x: x > 0, "must be positive (KTO's beta scales the implicit reward beta * log(pi / pi_ref); "
                 "0 leaves nothing to learn, a negative value reverses desirable and undesirable); 0.1 is usual"),
    "kto_desirable_weight": (lambda x: x > 0, "must be positive (KTO's lambda_D, the weight of the desirable "
                             "samples' loss; 0 drops them, a negative value trains away from them)"),
    "kto_undesirable_weight": (lambda x: x > 0, "must be positive (KTO's lambda_U, the weight of the undesirable "
                               "samples' loss; 0 drops them, a negative value trains towards them)"),
    "z_loss": (lambda x: x >= 0, "must not be negative (the reward model's penalty on squared rewards; a negative "
               "one rewards unbounded rewards); 0 turns it off"),
}


def _check_objective_coefficients(v: dict[str, Any], sources: dict[str, str]) -> None:
    for name, (allowed, requirement) in OBJECTIVE_COEFFICIENTS.items():
        if not allowed(v[name]):
            raise _fail(sources, name, f"{requirement}; got {v[name]}")


def _check_generation_ranges(v: dict[str, Any], sources: dict[str, str]) -> None:
    """generate.py's settings, in the ranges where they generate something (GPT-NeoX's meanings)."""
    for name in ("temperature", "top_k"):
        if v[name] < 0:
            raise _fail(sources, name, f"must not be negative (0: off), got {v[name]}")
    if not 0 <= v["top_p"] <= 1:
        raise _fail(sources, "top_p", f"must be a probability in [0, 1] (0: off), got {v['top_p']}")
    for name, what in (("maximum_tokens", "tokens generated per prompt"), ("num_samples", "samples generated")):
        if v[name] < 1:
            raise _fail(sources, name, f"must be at least 1 (the {what}; fewer generates nothing), got {v[name]}")


def _enabled(section: dict | None) -> bool:
    return bool(section) and bool(section.get("enabled", False))


def _derive_precision(v: dict[str, Any], sources: dict[str, str]) -> None:
    fp16_on, bf16_on = _enabled(v["fp16"]), _enabled(v["bf16"])
    if fp16_on and bf16_on:
        raise ConfigError(
            f"{where(sources, 'fp16')} and {where(sources, 'bf16')}: both enabled; enable at most one"
        )
    from_sections = precision_of(None, v["fp16"], v["bf16"])
    precision = v["precision"]
    if precision is None:
        precision = from_sections
    elif precision != from_sections and (fp16_on or bf16_on or _explicitly_off(v, precision)):
        raise ConfigError(
            f"{where(sources, 'precision')}: {precision!r} contradicts the fp16/bf16 sections, which say "
            f"{from_sections!r}; make them agree or drop one"
        )
    v["precision"] = precision
    for name in ("fp16", "bf16"):
        section = {key: val for key, val in (v[name] or {}).items() if key not in NEOX_ONLY_FP16_KEYS}
        v[name] = {**section, "enabled": True} if precision == name else None
        if v[name] is not None:
            _check_with_deepspeed_model(name, v[name], sources)


def _explicitly_off(v: dict[str, Any], precision: str) -> bool:
    """precision: fp16 with `fp16: {enabled: false}` given is a contradiction; with no fp16 section it is not."""
    section = v.get(precision)
    return isinstance(section, dict) and "enabled" in section and not section["enabled"]


def _derive_zero_stage(v: dict[str, Any], sources: dict[str, str]) -> None:
    zero = dict(v["zero_optimization"] or {})
    stage = zero_stage_of(zero)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise _fail(sources, "zero_optimization", f"stage must be 0, 1, 2 or 3, got {stage!r}")
    zero["stage"] = stage
    _check_with_deepspeed_model("zero_optimization", zero, sources)
    v["zero_optimization"] = zero
    v["zero_stage"] = stage


def _check_with_deepspeed_model(name: str, section: dict[str, Any], sources: dict[str, str]) -> None:
    """Let DeepSpeed's own config model reject unknown, ill-typed or out-of-range keys now, not at engine start."""
    from pydantic import ValidationError

    try:
        deepspeed_sections()[name](**section)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(map(str, (name, *first["loc"])))
        location = f"{sources[name]}: {key}" if name in sources else f"{key} (default)"
        if first["type"] == "extra_forbidden":
            raise ConfigError(f"{location}: not a key of DeepSpeed's {name} section; remove it or check its spelling") from None
        raise ConfigError(f"{location}: DeepSpeed rejects {first.get('input')!r}: {first['msg']}") from None


def _derive_optimizer(v: dict[str, Any], sources: dict[str, str], require_run_settings: bool) -> None:
    optimizer = v["optimizer"]
    if optimizer is None:
        optimizer = {"type": "Adam", "params": {}}
    if not isinstance(optimizer.get("params", {}), dict) or set(optimizer) - {"type", "params"}:
        raise _fail(sources, "optimizer", "expected {type: Adam|AdamW|SGD, params: {lr: ..., ...}}")
    kind = str(optimizer.get("type", "Adam"))
    if kind.lower() not in OPTIMIZER_TYPES:
        raise _fail(sources, "optimizer", f"type {kind!r} is not supported; use one of Adam, AdamW, SGD")
    params = dict(optimizer.get("params") or {})
    if params.get("lr") is not None and "lr" not in sources and "optimizer" in sources:
        sources["lr"] = sources["optimizer"]
    v["lr"] = _agree(v, sources, "lr", params.get("lr"), "optimizer.params.lr")
    if v["lr"] is None and require_run_settings:
        v["lr"] = GPT_NEOX_DEFAULT_LR
    if v["lr"] is not None and v["lr"] <= 0:
        raise _fail(sources, "lr", f"must be positive, got {v['lr']}")
    given_decay = params.get("weight_decay")
    if given_decay is not None and "weight_decay" in sources and given_decay != v["weight_decay"]:
        raise ConfigError(
            f"{where(sources, 'weight_decay')} ({v['weight_decay']}) and {where(sources, 'optimizer')}.params."
            f"weight_decay ({given_decay}) disagree; set it once"
        )
    if given_decay is not None:
        v["weight_decay"] = given_decay
    params["weight_decay"] = v["weight_decay"]
    if v["lr"] is not None:
        params["lr"] = v["lr"]
    _check_optimizer_params(OPTIMIZER_TYPES[kind.lower()], params, v["zero_optimization"], sources)
    v["optimizer"] = {"type": OPTIMIZER_TYPES[kind.lower()], "params": params}


def _optimizer_deepspeed_builds(kind: str, params: dict[str, Any], zero: dict[str, Any]) -> tuple[type, set[str]]:
    """The optimizer class DeepSpeed's engine builds for `kind` and the params keys DeepSpeed itself consumes.

    Its rule (engine._configure_basic_optimizer, the same from 0.16 on): Adam and AdamW are torch's with
    `torch_adam`, DeepSpeedCPUAdam when ZeRO offloads the optimizer to the CPU, FusedAdam otherwise;
    any other type is the torch.optim class of that name.
    """
    import torch

    if kind == "SGD":
        return torch.optim.SGD, set()
    consumed = {"torch_adam", "adam_w_mode"}
    if params.get("torch_adam"):
        return (torch.optim.AdamW if kind == "AdamW" else torch.optim.Adam), consumed
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    offload = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    return (DeepSpeedCPUAdam if offload else FusedAdam), consumed


def _check_optimizer_params(kind: str, params: dict[str, Any], zero: dict[str, Any], sources: dict[str, str]) -> None:
    """An optimizer.params key the optimizer does not take fails here in one line, not as a TypeError on a rank."""
    location = f"{sources['optimizer']}: optimizer.params" if "optimizer" in sources else "optimizer.params"
    if "max_grad_norm" in params:
        raise ConfigError(f"{location}.max_grad_norm: DeepSpeed clips with gradient_clipping; set that instead")
    optimizer_class, consumed = _optimizer_deepspeed_builds(kind, params, zero)
    # the parameters and DeepSpeedCPUAdam's adamw_mode are DeepSpeed's to pass
    accepted = (set(inspect.signature(optimizer_class).parameters) - {"params", "model_params", "adamw_mode"}) | consumed
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ConfigError(f"{location}.{unknown[0]}: not a parameter of {optimizer_class.__name__}, which DeepSpeed "
                          f"builds for type {kind} here (it takes {', '.join(sorted(accepted))}); remove it")


def _agree(v: dict[str, Any], sources: dict[str, str], name: str, other: Any, other_name: str) -> Any:
    if other is None:
        return v[name]
    if v[name] is not None and v[name] != other:
        raise ConfigError(f"{where(sources, name)} is {v[name]} but {other_name} is {other}; set it once")
    return other


def _derive_world(v: dict[str, Any], sources: dict[str, str], notices: list[str]) -> None:
    num_nodes = None if v["num_nodes"] == -1 else v["num_nodes"]
    if (v["hostfile"] is not None and not Path(v["hostfile"]).is_file() and not (num_nodes or 1) > 1
            and v["node_rank"] is None):
        # what DeepSpeed's launcher does with a hostfile that is not there: warn, run on this machine
        notices.append(f"notice: {where(sources, 'hostfile')}: {v['hostfile']!r} does not exist; "
                       "running on this machine only, as DeepSpeed does")
        v["hostfile"] = None
    hosts = active_hosts(v["num_gpus"], num_nodes, v["hostfile"], v["include"], v["exclude"])
    if v["node_rank"] is not None:
        _check_node_rank(v, sources, hosts)
    ranks = sum(len(slots) for _, slots in hosts)
    if v["global_num_gpus"] is not None and v["global_num_gpus"] != ranks:
        raise _fail(sources, "global_num_gpus", f"{v['global_num_gpus']}, but the launcher settings "
                    f"(num_gpus/num_nodes/hostfile/include/exclude) start {ranks} rank(s); remove global_num_gpus "
                    "or make them agree")
    v["global_num_gpus"] = ranks
    if v["context_parallel_size"] < 1:
        raise _fail(sources, "context_parallel_size", f"must be at least 1, got {v['context_parallel_size']}")
    model_ranks = v["model_parallel_size"] * max(v["pipe_parallel_size"], 1)
    if v["context_parallel_size"] > 1 and ranks % (model_ranks * v["context_parallel_size"]):
        raise _fail(sources, "context_parallel_size", f"{v['context_parallel_size']} x model_parallel_size "
                    f"{v['model_parallel_size']} x pipeline stages {max(v['pipe_parallel_size'], 1)} does not divide the "
                    f"{ranks} ranks (num_gpus x nodes); start a multiple of it or choose sizes whose product divides it")
    model_ranks *= v["context_parallel_size"]
    if v["pipe_parallel_size"] > 1 and ranks % model_ranks:
        raise _fail(sources, "pipe_parallel_size", f"{v['pipe_parallel_size']} stages x model_parallel_size "
                    f"{v['model_parallel_size']} = {model_ranks} ranks per model replica do not divide the {ranks} "
                    "ranks (num_gpus x nodes); start a multiple of it or choose sizes whose product divides it")
    if ranks % model_ranks:
        raise _fail(sources, "model_parallel_size", f"{v['model_parallel_size']} does not divide the {ranks} "
                    "ranks (num_gpus x nodes); every tensor-parallel group needs that many ranks, so start "
                    "a multiple of it or choose a size that divides the rank count")
    v["data_parallel_size"] = ranks // model_ranks


def _check_node_rank(v: dict[str, Any], sources: dict[str, str], hosts: list[tuple[str, list[int]]]) -> None:
    """node_rank: this deepy.py starts one node's ranks by itself (DeepSpeed's --no_ssh --node_rank), so
    every node must read the same hostfile and find node 0 at an address given, not asked over ssh."""
    node_rank = v["node_rank"]
    if v["deepspeed_slurm"] or v["deepspeed_mpi"]:
        launcher = "deepspeed_slurm" if v["deepspeed_slurm"] else "deepspeed_mpi"
        raise _fail(sources, "node_rank", f"{node_rank}, but {where(sources, launcher)} has srun/mpirun start "
                    "every node's ranks; keep one of them")
    if effective_hostfile(v["hostfile"]) is None:
        raise _fail(sources, "node_rank", f"{node_rank} needs a hostfile naming every node (lines `host slots=N`), "
                    "the same file on every node; set hostfile")
    if not 0 <= node_rank < len(hosts):
        names = ", ".join(host for host, _ in hosts)
        raise _fail(sources, "node_rank", f"{node_rank}, but the hostfile gives {len(hosts)} node(s) ({names}), "
                    f"numbered 0 to {len(hosts) - 1}; give each node its own number in that range")
    if not v["master_addr"]:
        raise _fail(sources, "node_rank", f"{node_rank} needs master_addr: the address of node 0 "
                    f"({hosts[0][0]}) that every node reaches, the same on every node; set master_addr")


def _derive_batch(v: dict[str, Any], sources: dict[str, str], require_run_settings: bool) -> None:
    """train_batch_size = micro x gradient_accumulation_steps x data_parallel_size; any two give the third."""
    micro, accum, total = (v["train_micro_batch_size_per_gpu"], v["gradient_accumulation_steps"],
                           v["train_batch_size"])
    dp = v["data_parallel_size"]
    names = "train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps"
    if micro is None and total is None:
        if not require_run_settings and accum is None:
            return
        raise ConfigError(f"{names}: none set; set train_micro_batch_size_per_gpu (and optionally the others)")
    if micro is not None and total is not None and accum is None:
        accum, remainder = divmod(total, micro * dp)
        if remainder or accum == 0:
            raise ConfigError(
                f"{where(sources, 'train_batch_size')} ({total}) is not a multiple of "
                f"{where(sources, 'train_micro_batch_size_per_gpu')} ({micro}) x data_parallel_size ({dp})"
            )
    accum = accum or 1
    if micro is None:
        micro, remainder = divmod(total, accum * dp)
        if remainder or micro == 0:
            raise ConfigError(
                f"{where(sources, 'train_batch_size')} ({total}) is not a multiple of "
                f"{where(sources, 'gradient_accumulation_steps')} ({accum}) x data_parallel_size ({dp})"
            )
    if total is None:
        total = micro * accum * dp
    if v["train_iters"] is not None and v["train_iters"] * total > INT64_MAX:
        raise _fail(sources, "train_iters", f"{v['train_iters']} iterations of {total} samples are more samples than "
                    f"a 64-bit integer counts (at most {INT64_MAX}); give fewer iterations")
    if micro * accum * dp != total:
        raise ConfigError(
            f"{where(sources, 'train_batch_size')} ({total}) != {where(sources, 'train_micro_batch_size_per_gpu')} "
            f"({micro}) x {where(sources, 'gradient_accumulation_steps')} ({accum}) x data_parallel_size ({dp}); "
            "set two of them and let the third follow"
        )
    v["train_micro_batch_size_per_gpu"], v["gradient_accumulation_steps"], v["train_batch_size"] = micro, accum, total


def _check_zero_supports_the_optimizer(v: dict[str, Any], sources: dict[str, str]) -> None:
    """DeepSpeed's engine asserts, at launch, that ZeRO runs only optimizers it has tested; say so before."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    kind = v["optimizer"]["type"]
    allowed = v["zero_allow_untested_optimizer"] or (v["deepspeed_extra_args"] or {}).get("zero_allow_untested_optimizer")
    # DeepSpeed builds a type it does not know itself as torch.optim.<type>
    untested = kind.lower() not in DEEPSPEED_OPTIMIZERS and getattr(torch.optim, kind) not in ZERO_SUPPORTED_OPTIMIZERS
    if untested and v["zero_stage"] >= 1 and not allowed:
        raise ConfigError(
            f"{where(sources, 'optimizer')}: type {kind} with {where(sources, 'zero_optimization')} stage "
            f"{v['zero_stage']}: DeepSpeed has not tested ZeRO with {kind} and refuses it at launch; set "
            "zero_allow_untested_optimizer: true to run it anyway, or use Adam/AdamW, or ZeRO stage 0"
        )


def _derive_model_shape(v: dict[str, Any], sources: dict[str, str]) -> None:
    hidden, heads = v["hidden_size"], v["num_attention_heads"]
    if v["kv_channels"] is not None and v["kv_channels"] < 1:
        raise _fail(sources, "kv_channels", f"must be at least 1 when set, got {v['kv_channels']}")
    if hidden % heads and v["kv_channels"] is None:
        raise ConfigError(
            f"{where(sources, 'hidden_size')} ({hidden}) is not divisible by "
            f"{where(sources, 'num_attention_heads')} ({heads}); set each head's width with kv_channels"
        )
    head_dim = v["kv_channels"] or hidden // heads
    v["num_kv_heads"] = v["num_kv_heads"] or heads
    if heads % v["num_kv_heads"]:
        raise ConfigError(
            f"{where(sources, 'num_attention_heads')} ({heads}) is not divisible by "
            f"{where(sources, 'num_kv_heads')} ({v['num_kv_heads']})"
        )
    if v["pos_emb"] == "rotary":
        rotary_dims = int(head_dim * v["rotary_pct"])
        if rotary_dims < 2 or rotary_dims % 2:
            raise _fail(sources, "rotary_pct", f"rotates {rotary_dims} of {head_dim} head dims; needs an even number >= 2")
    try:
        v["rope_scaling"] = rope_scaling_of(v["rope_scaling"])
    except ModelConfigError as err:  # its message names rope_scaling
        raise ConfigError(f"{sources.get('rope_scaling', '<defaults>')}: {err}") from None
    if v["rope_scaling"] is not None and v["pos_emb"] != "rotary":
        raise _fail(sources, "rope_scaling", f"scales rotary embedding, but pos_emb is {v['pos_emb']!r}")
    try:
        width = built_intermediate_size(hidden, v["intermediate_size"], v["activation"], v["mlp_multiple_of"])
    except ModelConfigError as err:
        raise _fail(sources, "intermediate_size", str(err)) from None
    try:
        gelu_approximation(v["activation"], v["bias_gelu_fusion"], v["onnx_safe"])
    except ModelConfigError as err:
        raise ConfigError(f"{where(sources, 'bias_gelu_fusion')} and {where(sources, 'onnx_safe')}: {err}") from None
    problem = tensor_parallel_split_problem(v["model_parallel_size"], heads, v["num_kv_heads"], width)
    if problem:
        raise _fail(sources, "model_parallel_size", problem)
    setting_problem = query_key_norm_problem(v)
    if setting_problem:
        raise _fail(sources, *setting_problem)
    v["max_position_embeddings"] = v["max_position_embeddings"] or v["seq_length"]
    if v["max_position_embeddings"] < v["seq_length"]:
        raise ConfigError(
            f"{where(sources, 'max_position_embeddings')} ({v['max_position_embeddings']}) is shorter than "
            f"{where(sources, 'seq_length')} ({v['seq_length']})"
        )


def _derive_schedule(v: dict[str, Any], sources: dict[str, str]) -> None:
    fraction = v["lr_decay_fraction"]
    if fraction is not None and not 0 < fraction <= 1:
        raise _fail(sources, "lr_decay_fraction", f"must be in (0, 1], got {fraction}")
    if v["lr_decay_iters"] is None and fraction is not None and v["train_iters"] is not None:
        v["lr_decay_iters"] = max(1, math.floor(v["train_iters"] * fraction))
    v["lr_decay_iters"] = v["lr_decay_iters"] or v["train_iters"]
    if v["warmup"] > 1:
        raise _fail(sources, "warmup", f"{v['warmup']}: warmup is a fraction of lr_decay_iters (as in GPT-NeoX), "
                                       "at most 1; for N warmup iterations write N / lr_decay_iters")
    # GPT-NeoX does not round: 0.01 x 1500 iterations warms up over 15.000000000000002 of them
    v["warmup_iters"] = None if v["lr_decay_iters"] is None else v["warmup"] * v["lr_decay_iters"]
    if v["lr"] is not None and v["min_lr"] > v["lr"]:
        raise ConfigError(f"{where(sources, 'min_lr')} ({v['min_lr']}) is above the peak lr ({v['lr']})")
    if v["override_lr_scheduler"] and v["use_checkpoint_lr_scheduler"]:
        raise ConfigError(f"{where(sources, 'override_lr_scheduler')} and {where(sources, 'use_checkpoint_lr_scheduler')}: "
                          "both set; the schedule comes either from the configs or from the checkpoint, keep one")


def _derive_checkpointing(v: dict[str, Any], sources: dict[str, str]) -> None:
    factor, interval = v["checkpoint_factor"], v["save_interval"]
    if factor is not None and interval is not None and factor != interval:
        raise ConfigError(
            f"{where(sources, 'checkpoint_factor')} ({factor}) and {where(sources, 'save_interval')} ({interval}) "
            "are the same setting with different values; set one"
        )
    v["checkpoint_factor"] = v["save_interval"] = factor if factor is not None else interval
    extra = v["extra_save_iters"]
    if extra is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in extra):
        raise _fail(sources, "extra_save_iters", f"expected a list of iteration numbers (whole numbers >= 0), got {extra!r}")
    for flag in ("finetune", "no_load_optim"):
        if v[flag] and not v["load"]:
            raise ConfigError(f"{where(sources, flag)}: set but `load` is not; say which checkpoint to load")


def _check_profiling(v: dict[str, Any], sources: dict[str, str]) -> None:
    if v["profile"] or v["memory_profiling"]:
        if not 0 <= v["profile_step_start"] < v["profile_step_stop"]:
            raise ConfigError(f"{where(sources, 'profile_step_start')} ({v['profile_step_start']}) must be below "
                              f"{where(sources, 'profile_step_stop')} ({v['profile_step_stop']}) and not negative")
    if v["profile"] and not v["tensorboard_dir"]:
        raise _fail(sources, "profile", "the trace is written to tensorboard_dir (as in GPT-NeoX); set tensorboard_dir")
    if v["memory_profiling"] and not v["memory_profiling_path"]:
        raise _fail(sources, "memory_profiling", "needs memory_profiling_path, the folder for the snapshot")


def _check_train_impl(v: dict[str, Any], sources: dict[str, str]) -> None:
    if v["train_impl"] == "reinforce":
        _check_reinforce(v, sources)
    elif v["dataset_impl"] == "online":
        raise _fail(sources, "dataset_impl", "online serves REINFORCE's scored completions: set train_impl: "
                                             "reinforce, or dataset_impl gpt2 / pairwise")
    if v["train_impl"] != "normal" and (v["pipe_parallel_size"] or 0) > 1:
        raise _fail(sources, "pipe_parallel_size", f"train_impl {v['train_impl']} runs without pipeline parallelism "
                                                   "(as in GPT-NeoX); set pipe_parallel_size to 0 or 1")
    if v["train_impl"] == "dpo" and v.get("dataset_impl", "gpt2") != "pairwise":
        raise _fail(sources, "train_impl", "dpo trains on chosen/rejected pairs: set `dataset_impl: pairwise` with "
                                           "pos_train_data_paths / neg_train_data_paths (and their label paths)")
    if v["precompute_model_name"] and v["train_impl"] in ("dpo", "kto") and v.get("pack_impl") != "unpacked":
        raise _fail(sources, "precompute_model_name", "the precomputed log-probabilities hold one document per "
                                                      "sample, which only pack_impl unpacked keeps aligned; set "
                                                      "pack_impl: unpacked")
    if v["precompute_model_name"] and v["train_impl"] in ("dpo", "kto"):
        sides = ("pos_", "neg_") if v.get("dataset_impl") == "pairwise" else ("",)
        for paths in (f"{side}{split}_data_paths" for split in ("train", "valid", "test") for side in sides):
            labels = paths.replace("_data_paths", "_label_data_paths")
            if v.get(paths) and not v.get(labels):
                raise _fail(sources, "precompute_model_name", f"needs {labels} beside {paths}: without label "
                                                              "files each unpacked sample also trains the first "
                                                              "token of the next document, which the precomputed "
                                                              "log-probabilities (one document each) do not hold; "
                                                              "give the label files the preprocess tool writes")
    if v["train_impl"] == "kto" and v.get("train_data_paths") and not v.get("train_reward_data_paths"):
        raise _fail(sources, "train_impl", "kto weighs each sample by its reward: set train_reward_data_paths "
                                           "(preprocess_data_with_chat_template.py --reward-key), one per data path")
    # None: settings read back from a checkpoint, which do not restore the batch; the run's own files set it
    if v["train_impl"] == "kto" and v["train_micro_batch_size_per_gpu"] is not None and \
            v["train_micro_batch_size_per_gpu"] < 2:
        raise _fail(sources, "train_micro_batch_size_per_gpu", "train_impl kto estimates its KL reference point "
                                                               "from the other half of each micro batch: set it to "
                                                               "2 or more")
    if v["train_impl"] == "rm":
        _check_reward_model(v, sources)
    _check_packed_preferences(v, sources)


def _check_packed_preferences(v: dict[str, Any], sources: dict[str, str]) -> None:
    """Pairs (dpo, rm) or kto's rated answers packed several to a row score as the same records unpacked only
    when no document sees another and each counts its positions from 0 (their losses are per record)."""
    preference = v.get("dataset_impl") == "pairwise" or v["train_impl"] == "kto"
    if not preference or v.get("pack_impl") != "pack_until_overflow":
        return
    for name in ("reset_attention_mask", "reset_position_ids"):
        if not v[name]:
            raise _fail(sources, "pack_impl", f"pack_until_overflow packs several {v['train_impl']} records into a "
                        f"row, which scores each as it would be alone only with {name}: true; set it (and its "
                        "sibling reset_attention_mask / reset_position_ids), or pack_impl: unpacked")


def _check_reinforce(v: dict[str, Any], sources: dict[str, str]) -> None:
    """REINFORCE samples its completions here (scored by reward_function or reward_model) or reads scored ones
    from GPT-NeoX's data server (dataset_impl online), exactly one of them; built-in rollouts sample reinforce_num_completions completions of each prompt."""
    if v["kl_div_beta"] < 0:
        raise _fail(sources, "kl_div_beta", f"must not be negative (0: no reference, no KL), got {v['kl_div_beta']}")
    if v["reinforce_leave_one_out"] and v["reinforce_advantage"] not in (None, "leave_one_out"):
        raise _fail(sources, "reinforce_advantage", f"{v['reinforce_advantage']} contradicts reinforce_leave_one_out: "
                                                    "true; set one of them")
    named = [name for name in ("reward_function", "reward_model") if v[name]] + \
        (["dataset_impl"] if v["dataset_impl"] == "online" else [])
    if not named:
        raise _fail(sources, "train_impl", "reinforce needs a reward: set reward_function (\"file.py:name\") or "
                                           "reward_model (a train_impl rm checkpoint) to sample and score "
                                           "completions here, or dataset_impl: online to read scored completions "
                                           "from GPT-NeoX's data server")
    if len(named) > 1:
        shown = " and ".join("dataset_impl online (GPT-NeoX's data server)" if name == "dataset_impl" else name
                             for name in named)
        raise _fail(sources, named[-1], f"{shown} each name the reward; set exactly one of reward_function, "
                                        "reward_model and dataset_impl: online")
    if named == ["dataset_impl"]:
        if v["rollout_samples_shown"]:
            raise _fail(sources, "rollout_samples_shown", "shows completions sampled here (reward_function or "
                                                          "reward_model), not the data server's: set it to 0")
        if v["rollout_log"]:
            raise _fail(sources, "rollout_log", "logs completions sampled here (reward_function or reward_model), "
                                                "not the data server's, which keeps its own: remove rollout_log")
        return
    if v["reward_function"] and ":" not in v["reward_function"]:
        raise _fail(sources, "reward_function", f"{v['reward_function']!r} is not \"path/file.py:name\"; name the "
                                                "file and the function in it")
    if v["rollout_samples_shown"] < 0:
        raise _fail(sources, "rollout_samples_shown", f"must not be negative (0: none shown), got "
                                                      f"{v['rollout_samples_shown']}")
    if v["reinforce_num_completions"] < 1:
        raise _fail(sources, "reinforce_num_completions", f"must be at least 1, got {v['reinforce_num_completions']}")
    advantage = v["reinforce_advantage"] or ("leave_one_out" if v["reinforce_leave_one_out"] else "moving_average")
    if advantage != "moving_average" and v["reinforce_num_completions"] < 2:
        raise _fail(sources, "reinforce_num_completions", f"{advantage} compares the completions of one prompt: "
                                                          "sample 2 or more per prompt")
    if v["temperature"] == 0 and v["top_k"] == 0 and v["top_p"] == 0 and v["reinforce_num_completions"] > 1:
        raise _fail(sources, "temperature", "0 with top_k and top_p 0 samples greedily, so every completion of a "
                                            "prompt is the same; set temperature (e.g. 1.0) to sample")
    if v["pack_impl"] != "unpacked":
        raise _fail(sources, "pack_impl", "reinforce's prompts are whole chat records (one per sample): set "
                                          "pack_impl: unpacked")
    if not v["train_data_paths"] or not v["train_label_data_paths"]:
        raise _fail(sources, named[0], "reinforce's prompts are the chats of train_data_paths, cut before "
                                                "each one's first trained label: set train_data_paths and "
                                                "train_label_data_paths (the chat preprocess tool writes both)")


def _check_lora(v: dict[str, Any], sources: dict[str, str]) -> None:
    if v["lora_rank"] < 0:
        raise _fail(sources, "lora_rank", f"must not be negative (0: no LoRA), got {v['lora_rank']}")
    if not v["lora_rank"]:
        return
    if v["lora_alpha"] <= 0:
        raise _fail(sources, "lora_alpha", f"must be positive, got {v['lora_alpha']}")
    if not 0 <= v["lora_dropout"] < 1:
        raise _fail(sources, "lora_dropout", f"must be in [0, 1), got {v['lora_dropout']}")
    experts = (v["moe_num_experts"] or 1) > 1
    try:
        targets = target_modules_of(v["lora_target_modules"], gpt_neox_shaped(v["norm"], v["activation"]), experts)
    except ModelConfigError as err:
        raise _fail(sources, "lora_target_modules", str(err)) from None
    if v["lora_dropout"] and any(target_of(name).experts for name in targets):
        raise _fail(sources, "lora_dropout", f"is {v['lora_dropout']}, but an expert parameter's adapter adds to the "
                    "weight, where no dropout of the input applies (PEFT refuses it too); set lora_dropout: 0")
    if all(v[name] is not None for name in MODEL_REQUIRED):
        _check_lora_rank_fits(v, sources, targets)


def _check_lora_rank_fits(v: dict[str, Any], sources: dict[str, str], targets: tuple[str, ...]) -> None:
    """A rank above an adapted layer's smaller side adds nothing B A could not hold at that side's rank, and its
    A and B grow with the rank: a rank beyond it is a mistake (a typo, a hidden size), refused with the bound."""
    hidden = v["hidden_size"]
    width = built_intermediate_size(hidden, v["intermediate_size"], v["activation"], v["mlp_multiple_of"])
    shapes = target_shapes(hidden, v["num_attention_heads"], v["num_kv_heads"],
                           v["kv_channels"] or hidden // v["num_attention_heads"], width,
                           expert_width(hidden, v["moe_intermediate_size"], v["intermediate_size"], v["activation"]))
    module, (rows, columns) = min(((name, shapes[name]) for name in targets), key=lambda item: min(item[1]))
    if v["lora_rank"] > min(rows, columns):
        raise _fail(sources, "lora_rank", f"{v['lora_rank']} is above {min(rows, columns)}, the smaller side of the "
                    f"adapted layer {module} ({rows} x {columns}), the highest rank an adapter of it can have; set "
                    f"lora_rank to at most {min(rows, columns)} (8 to 64 is usual)")


def _check_reward_model(v: dict[str, Any], sources: dict[str, str]) -> None:
    """train_impl rm reads one reward per row, at the first trained position (the first of the two end tokens
    preprocess_data_with_chat_template.py --for-rm appends), from a scalar head in place of the output layer."""
    if not v["no_weight_tying"]:
        raise _fail(sources, "no_weight_tying", "train_impl rm replaces the output layer by a scalar head, so the "
                    "embeddings cannot be tied to it; set no_weight_tying: true (as GPT-NeoX requires)")
    if v["dataset_impl"] != "pairwise":
        raise _fail(sources, "dataset_impl", "train_impl rm compares a chosen with a rejected sequence; set "
                    "dataset_impl: pairwise with pos_/neg_*_data_paths")
    if v["pack_impl"] == "packed":
        raise _fail(sources, "pack_impl", "train_impl rm reads one reward per chat, which packed cuts apart: set "
                    "pack_impl: unpacked, or pack_until_overflow with reset_attention_mask and reset_position_ids")
    if v["eod_mask_loss"]:
        raise _fail(sources, "eod_mask_loss", "train_impl rm reads the reward where the loss mask is on, at an end "
                    "token, which eod_mask_loss would mask; remove it")
    for split in ("train", "valid", "test"):
        if v[f"pos_{split}_data_paths"] and not v[f"pos_{split}_label_data_paths"]:
            raise _fail(sources, f"pos_{split}_data_paths", f"train_impl rm reads each reward at the position its "
                        f"labels train; set pos_/neg_{split}_label_data_paths (preprocess_data_with_chat_template.py "
                        "--for-rm writes them)")


def _check_mixture_of_experts(v: dict[str, Any], sources: dict[str, str]) -> None:
    """What experts (moe_num_experts > 1) cannot do yet, refused before any rank starts (megatron/contract/architecture.py)."""
    problem = mixture_of_experts_problem(v)
    if problem:
        raise _fail(sources, *problem)
    if (v["moe_num_experts"] or 1) <= 1:
        return
    if v["zero_stage"] == 3:
        raise _fail(sources, "zero_optimization", "mixture of experts runs so far with ZeRO stages 0-2 (stage 3 "
                                                  "with experts is not tested yet); set stage 2")
    if not 0 < v["moe_collapse_token_share"] <= 1:
        raise _fail(sources, "moe_collapse_token_share", f"a share of a layer's tokens: must lie in (0, 1], got "
                                                         f"{v['moe_collapse_token_share']}")
    if v["moe_collapse_steps"] < 1:
        raise _fail(sources, "moe_collapse_steps", f"must be a positive number of steps, got {v['moe_collapse_steps']}")
    if v["moe_load_balancing_loss_coef"] < 0:
        raise _fail(sources, "moe_load_balancing_loss_coef", f"must not be negative, got "
                                                             f"{v['moe_load_balancing_loss_coef']}")
    if v["moe_load_balancing_loss"] and v["train_impl"] != "normal":
        raise _fail(sources, "moe_load_balancing_loss", f"the load-balancing loss is added to train_impl normal's "
                                                        f"loss only, not {v['train_impl']}'s; set it to false")


def _check_pipeline(v: dict[str, Any], sources: dict[str, str]) -> None:
    """What DeepSpeed's pipe engine (pipe_parallel_size > 1) cannot do, refused before any rank starts."""
    stages = v["pipe_parallel_size"]
    if stages <= 1:
        return
    if v["zero_stage"] >= 2:
        raise _fail(sources, "zero_optimization", f"stage {v['zero_stage']} with pipe_parallel_size {stages}: "
                    "DeepSpeed's pipe engine runs ZeRO stage 0 or 1 only (GPT-NeoX's pipelined recipes use 1); "
                    "set stage 1, or pipe_parallel_size 1")
    for name, why in (("log_grad_norm", "each stage holds only its own layers' gradients, and the pipe engine "
                       "steps inside its schedule"),
                      ("log_param_norm", "each stage holds only its own layers"),
                      ("torch_compile", "DeepSpeed's pipe engine runs its stages' layers one by one"),
                      ("checkpoint_validation_with_forward_pass", "the pipe engine runs no forward pass outside "
                       "train_batch and eval_batch")):
        if v[name]:
            raise _fail(sources, name, f"not available with pipe_parallel_size {stages}: {why}; turn it off or set "
                        "pipe_parallel_size 1")


def _check_sequence_parallel(v: dict[str, Any], sources: dict[str, str], notices: list[str]) -> None:
    """Sequence parallelism gives each tensor-parallel rank an equal part of every sequence; at one rank it has
    no effect, which is said as a GPT-NeoX setting without effect is."""
    tp = v["model_parallel_size"]
    if v["sequence_parallel"] and tp == 1 and "sequence_parallel" in sources:
        notices.append(f"notice: {where(sources, 'sequence_parallel')} has no effect here (only matters at a "
                       "tensor-parallel size above 1, and model_parallel_size is 1)")
    if v["sequence_parallel"] and tp > 1 and v["seq_length"] and v["seq_length"] % tp:
        raise _fail(sources, "sequence_parallel", f"splits each sequence over the {tp} tensor-parallel ranks, but "
                    f"seq_length {v['seq_length']} is no multiple of {tp}; set a seq_length that is one, or "
                    "sequence_parallel: false")


def _check_context_parallel(v: dict[str, Any], sources: dict[str, str]) -> None:
    """Context parallelism cuts every sequence into 2 x size equal chunks; what it is not built with is refused."""
    cp = v["context_parallel_size"]
    if cp == 1:
        return
    if v["seq_length"] and v["seq_length"] % (2 * cp):
        raise _fail(sources, "context_parallel_size", f"{cp} cuts each sequence into {2 * cp} equal chunks, but "
                    f"seq_length {v['seq_length']} is no multiple of {2 * cp}; set a seq_length that is one")
    unbuilt = (("pipe_parallel_size", v["pipe_parallel_size"] > 1, "pipeline stages"),
               ("train_impl", v["train_impl"] not in ("normal", "dpo", "kto", "rm"),
                f"train_impl {v['train_impl']} (normal, dpo, kto and rm only)"),
               ("precompute_model_name", bool(v["precompute_model_name"]), "precomputed reference log-probabilities"),
               ("moe_num_experts", v["moe_num_experts"] > 1, "experts"),
               ("sequence_parallel", v["sequence_parallel"] and v["model_parallel_size"] > 1, "sequence parallelism"))
    for name, switched_on, what in unbuilt:
        if switched_on:
            raise _fail(sources, name, f"context_parallel_size {cp} is not built with {what}; turn it off or set "
                        "context_parallel_size: 1")


def _check_data(v: dict[str, Any], sources: dict[str, str]) -> None:
    pairwise = v["dataset_impl"] == "pairwise"
    _check_pairwise_data(v, sources, pairwise)
    given = [name for name in ("data_path", "train_data_paths", "pos_train_data_paths", "embedded_corpus") if v[name]
             and sources.get(name) != EMBEDDED_CORPUS_SOURCE]
    if not given and v["train_impl"] == "reinforce" and v["dataset_impl"] == "online":
        given = ["online_dataserver_ports"]  # GPT-NeoX's data server gives the data; its data paths are not read
    if not given:
        if pairwise:
            raise _fail(sources, "dataset_impl", "pairwise reads its training pairs from pos_train_data_paths and "
                        "neg_train_data_paths; set both")
        raise ConfigError(
            "data_path / train_data_paths / embedded_corpus: no training data; set data_path (a .bin/.idx "
            "prefix), train_data_paths, or `embedded_corpus: true`"
        )
    if len(given) > 1:
        raise ConfigError(" and ".join(where(sources, name) for name in given) + ": set only one data source")
    if v["data_path"] or v["embedded_corpus"]:
        _check_split(v["split"], sources, v["train_iters"])
    for split in ("train", "valid", "test"):
        data = f"{'pos_' if pairwise else ''}{split}_data_paths"
        paths, weights = v[data], v[f"{split}_data_weights"]
        if weights is not None and (paths is None or len(weights) != len(paths)):
            raise _fail(sources, f"{split}_data_weights", f"needs one weight per entry of {data}")
        if weights is not None:
            _check_data_weights(weights, paths, f"{split}_data_weights", sources)
        if v[f"{split}_reward_data_paths"] and v["pack_impl"] == "packed":
            raise _fail(sources, f"{split}_reward_data_paths", "rewards are per document, so they need whole "
                        "documents: pack_impl unpacked (one document per sample, as in GPT-NeoX) or "
                        "pack_until_overflow, not packed")
    if not v["embedded_corpus"]:  # the embedded corpus brings its own tokenizer
        kind = v["tokenizer_type"]
        for name, what in TOKENIZER_FILES.get(kind, {}).items():
            if not v[name]:
                default = "" if "tokenizer_type" in sources else " (GPT-NeoX's default tokenizer_type)"
                raise _fail(sources, name, f"tokenizer_type {kind}{default} needs {name} ({what})")


def _check_pairwise_data(v: dict[str, Any], sources: dict[str, str], pairwise: bool) -> None:
    """pos_/neg_ paths only with dataset_impl pairwise, then in pairs of equal length; whole documents."""
    for split in ("train", "valid", "test"):
        pairs = [f"{sign}_{split}_{kind}data_paths" for kind in ("", "label_") for sign in ("pos", "neg")]
        if not pairwise:
            for name in pairs:
                if v[name]:
                    raise _fail(sources, name, "chosen/rejected pairs are read by dataset_impl: pairwise; set it "
                                "(GPT-NeoX's dpo and rm recipes do)")
            continue
        for name in (f"{split}_data_paths", f"{split}_label_data_paths", f"{split}_reward_data_paths"):
            if v[name]:
                raise _fail(sources, name, f"dataset_impl pairwise reads pos_{split}_data_paths and "
                            f"neg_{split}_data_paths instead; remove it (or use dataset_impl: gpt2)")
        pos, neg, pos_label, neg_label = pairs
        for first, second in ((pos, neg), (neg, pos), (pos_label, neg_label), (neg_label, pos_label)):
            if v[first] and not v[second]:
                raise _fail(sources, first, f"needs {second} beside it (chosen prefix k pairs with rejected prefix k)")
        for name in (neg, pos_label, neg_label):
            if v[name] and len(v[name]) != len(v[pos] or []):
                raise _fail(sources, name, f"has {len(v[name])} prefixes for the {len(v[pos] or [])} of {pos}; give one "
                            "per entry, in the same order")
    if pairwise and (v["data_path"] or v["embedded_corpus"]):
        name = "data_path" if v["data_path"] else "embedded_corpus"
        raise _fail(sources, name, "dataset_impl pairwise reads its pairs from pos_/neg_{train,valid,test}_data_paths; "
                    "remove it (or use dataset_impl: gpt2)")
    if pairwise and v["pack_impl"] == "packed":
        raise _fail(sources, "pack_impl", "dataset_impl pairwise needs whole documents (packed cuts a chosen and "
                    "its rejected document apart, GPT-NeoX asserts the same); use unpacked or pack_until_overflow")


def _check_data_weights(weights: list, paths: list, name: str, sources: dict[str, str]) -> None:
    from megatron.data.blendable_dataset import normalize_weights
    from megatron.data.errors import DataError

    try:
        normalize_weights(weights, paths, name)
    except DataError as err:
        raise ConfigError(f"{sources[name]}: {err}" if name in sources else str(err)) from None


def _check_split(split: str, sources: dict[str, str], train_iters: int | None) -> None:
    from megatron.data.builders import parse_split
    from megatron.data.errors import DataError

    try:
        train_share = parse_split(split)[0]
    except DataError as err:
        raise _fail(sources, "split", str(err)) from None
    if train_share == 0 and train_iters:
        raise _fail(sources, "split", f"{split!r} gives the training split no documents; give it a share "
                    "(the first number), e.g. '969, 30, 1'")
