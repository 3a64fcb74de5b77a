"""The one schema of every setting: name, type, default, allowed values and a one-line doc.

A setting is defined here and nowhere else. Names follow GPT-NeoX wherever GPT-NeoX has the
setting, written with underscores (YAML may use dashes; loading normalises them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    name: str
    type: type | tuple[type, ...]
    default: Any
    doc: str
    group: str
    choices: tuple[Any, ...] | None = None
    derived: bool = False  # computed from other settings; a YAML may not set it
    # GPT-NeoX has this setting (a field of its NeoXArgs); ours alone are saved beside its config, not in it
    gpt_neox: bool = True


def _s(group: str):
    def make(name, type_, default, doc, choices=None, derived=False, gpt_neox=True):
        return Setting(name, type_, default, doc, group, choices, derived, gpt_neox)

    return make


_model = _s("model")
_train = _s("training")
_ckpt = _s("checkpointing")
_data = _s("data")
_launch = _s("launcher")
_log = _s("logging")
_ds = _s("deepspeed")  # DeepSpeed config keys GPT-NeoX puts in the DeepSpeed config when not at their default
_derived = _s("derived")
_gen = _s("generation")  # read by generate.py, as GPT-NeoX's text_generation.yml sets them
_eval = _s("evaluation")  # read by eval.py (the LM Evaluation Harness)

OPT_INT = (int, type(None))
OPT_FLOAT = (float, int, type(None))
OPT_STR = (str, type(None))
FLOAT = (float, int)

SETTINGS_LIST: list[Setting] = [
    # --- model architecture -------------------------------------------------------------
    _model("num_layers", int, None, "number of transformer layers"),
    _model("hidden_size", int, None, "width of the residual stream"),
    _model("num_attention_heads", int, None, "number of query attention heads"),
    _model("num_kv_heads", OPT_INT, None, "key/value heads for grouped-query attention; unset means one per query head"),
    _model("intermediate_size", OPT_INT, None, "MLP width before GPT-NeoX's rule (unset: 4 x hidden); swiglu builds int(2/3 of it) for gate + up together, see megatron/contract/architecture.py"),
    _model("mlp_multiple_of", int, 1, "round the MLP widths up to multiples of this (linear1 to twice it), as GPT-NeoX does"),
    _model("seq_length", int, None, "tokens per training sample"),
    _model("sliding_window_width", OPT_INT, None, "Mistral's sliding window: a token attends to itself and the `width` tokens before it; unset: the whole causal prefix"),
    _model("kv_channels", OPT_INT, None, "width of each attention head (megatron-core's name, Hugging Face's head_dim); unset: hidden_size / num_attention_heads", gpt_neox=False),
    _model("qk_layernorm", bool, False, "normalise each head's query and key (the model's norm over the head's width, one weight for queries, one for keys) before rotary, as megatron-core and Qwen3 do", gpt_neox=False),
    _model("qk_layernorm_across_heads", bool, False, "instead of qk_layernorm's per-head norm: one norm over all heads' queries together and one over all heads' keys, weights as wide as the query / key projection, before rotary, as OLMoE does (with tensor parallelism: rmsnorm, at least one key/value head per rank)", gpt_neox=False),
    _model("add_qkv_bias", bool, False, "biases on the query/key/value projection even where use_bias_in_attn_linear is false (megatron-core's name; Qwen2)", gpt_neox=False),
    _model("max_position_embeddings", OPT_INT, None, "longest sequence the position embedding supports; unset means seq_length"),
    _model("pos_emb", str, "learned", "position embedding", choices=("learned", "rotary", "none")),
    _model("rotary_pct", FLOAT, 1.0, "fraction of each head's dimensions that rotary embedding rotates"),
    _model("rotary_emb_base", int, 10000, "rotary embedding base (Llama's rope_theta)"),
    _model("rope_scaling", (dict, type(None)), None, "RoPE scaling as a Hugging Face config records it: {rope_type: linear|llama3|yarn, factor: ..., ...} (megatron/contract/architecture.py); unset: plain rotary", gpt_neox=False),
    _model("no_weight_tying", bool, False, "untie the input embedding and the output layer"),
    _model("gpt_j_residual", bool, False, "parallel residual: attention and MLP both read the layer input (GPT-NeoX/Pythia)"),
    _model("norm", str, "layernorm", "normalisation layer", choices=("layernorm", "rmsnorm")),
    _model("layernorm_epsilon", float, 1.0e-5, "LayerNorm epsilon"),
    _model("rms_norm_epsilon", float, 1.0e-8, "RMSNorm epsilon"),
    _model("activation", str, "gelu", "MLP activation; swiglu is Llama's gated SiLU MLP", choices=("gelu", "relu", "silu", "swiglu")),
    _model("bias_gelu_fusion", bool, False, "gelu: use the tanh approximation of GELU (GPT-NeoX's fused bias-GELU kernel computes it)"),
    _model("onnx_safe", bool, False, "gelu: use GPT-NeoX's ONNX-exportable erf GELU (x/1.41421 inside erf)"),
    _model("use_bias_in_norms", bool, True, "LayerNorm has a bias"),
    _model("use_bias_in_attn_linear", bool, True, "attention projections have biases"),
    _model("use_bias_in_mlp", bool, True, "MLP projections have biases"),
    _model("hidden_dropout", FLOAT, 0.0, "dropout on the residual branches"),
    _model("attention_dropout", FLOAT, 0.0, "dropout on the attention probabilities"),
    _model("init_method", str, "normal", "initialisation of input-side weights", choices=("normal", "small_init", "wang_init", "scaled_normal")),
    _model("output_layer_init_method", str, "scaled_normal", "initialisation of output-side weights (attention dense, MLP linear2)", choices=("normal", "small_init", "wang_init", "scaled_normal")),
    _model("init_method_std", float, 0.02, "standard deviation of the normal initialisers"),
    _model("checkpoint_activations", bool, False, "recompute each layer's activations in the backward pass to save memory"),
    _model("moe_num_experts", int, 1, "experts in each mixture-of-experts layer; 1: no experts, every layer has its MLP (megatron/contract/architecture.py)"),
    _model("moe_top_k", int, 1, "experts each token is routed to in a mixture-of-experts layer"),
    _model("moe_expert_interval", int, 1, "layer i (from 0) has experts when i % moe_expert_interval == 0; the others keep their MLP"),
    _model("moe_router_type", str, "sinkhorn", "how tokens are routed to experts: topk (the moe_top_k most probable experts by the router's softmax) or sinkhorn (GPT-NeoX's: in training the top k of a Sinkhorn-balanced assignment, weighed by the sigmoid (top 1) or softmax of the router's logits)", choices=("sinkhorn", "topk")),
    _model("moe_jitter_eps", OPT_FLOAT, None, "topk router only, in training: multiply the router's input by noise drawn uniformly from [1 - eps, 1 + eps]"),
    _model("moe_intermediate_size", OPT_INT, None, "each expert's MLP width per projection (Hugging Face's moe_intermediate_size; Mixtral's intermediate_size); unset: GPT-NeoX's expert rule, intermediate_size itself or 4 x hidden (swiglu: 8/3 x hidden) rounded up to 256", gpt_neox=False),
    _model("moe_norm_topk_prob", bool, False, "renormalise the chosen experts' router probabilities to sum to 1 before weighing their outputs (Hugging Face's norm_topk_prob; Mixtral always does)", gpt_neox=False),
    _model("moe_shared_expert_intermediate_size", OPT_INT, None, "with experts: every token also goes through a shared expert, the model's dense MLP this wide (no biases), weighed by the sigmoid of a linear of the token (hidden -> 1) and added to the experts' output (Hugging Face's Qwen2-MoE shared_expert_intermediate_size); unset or 0: none", gpt_neox=False),
    _model("moe_load_balancing_loss", bool, False, "add Hugging Face's load-balancing loss over the router's choices to the loss (its output_router_logits), reported as load_balancing_loss", gpt_neox=False),
    _model("moe_load_balancing_loss_coef", FLOAT, 0.001, "weight of the load-balancing loss in the loss (Hugging Face's router_aux_loss_coef)", gpt_neox=False),
    _model("hf_model_type", OPT_STR, None, "the Hugging Face family (config.json's model_type) the model came from, which convert_neox_to_hf.py writes back; unset: the family the architecture implies", choices=(None, "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"), gpt_neox=False),
    _model("make_vocab_size_divisible_by", int, 128, "pad the vocabulary to a multiple of this"),
    _model("model_parallel_size", int, 1, "tensor-parallel size: ranks that split each layer (heads, MLP, vocabulary) between them"),
    _model("sequence_parallel", bool, False, "at model_parallel_size > 1: split the norms, dropout and residual "
           "stream along the sequence over the tensor-parallel ranks (Megatron's sequence parallelism: less "
           "activation memory, the same steps); seq_length must be a multiple of model_parallel_size"),
    _model("context_parallel_size", int, 1, "context-parallel size (megatron-core's name): ranks that split each "
           "sequence between them, Megatron's load-balanced causal chunks, keys and values all-gathered for an exact "
           "attention; seq_length must be a multiple of 2 x context_parallel_size (docs/configuration.md)",
           gpt_neox=False),
    _model("pipe_parallel_size", int, 0, "pipeline stages (DeepSpeed's pipe engine); 0 or 1: no pipeline, the "
           "model trains as one module (GPT-NeoX's to_sequential)"),
    _model("pipe_partition_method", str, "type:transformer|mlp", "how layers are spread over the pipeline stages: "
           "uniform (as many layers each), parameters (as many parameters each) or type:<regex> (as many layers "
           "whose class name matches each)"),
    # --- optimisation ---------------------------------------------------------------------
    _train("train_impl", str, "normal", "the objective (megatron/objectives): normal (language modelling, SFT), "
           "dpo, kto, rm (reward model) or reinforce", choices=("normal", "dpo", "kto", "rm", "reinforce")),
    _train("z_loss", FLOAT, 0.0, "train_impl rm: weight of the penalty on the squared rewards, "
           "z_loss x mean(chosen^2 + rejected^2), added to the loss"),
    _train("dpo_beta", FLOAT, 0.1, "DPO's beta: the scale of the implicit rewards beta * (log pi - log pi_ref)"),
    _train("dpo_fp32", bool, True, "DPO: cast the logits to fp32 before taking log-probabilities"),
    _train("dpo_reference_free", bool, False, "DPO without a reference model (its log-probabilities taken as 0)"),
    _train("precompute_model_name", OPT_STR, None, "DPO and KTO read the reference's log-probabilities from "
           "{data path}_{this name}.bin/.idx (written by generate.py with text_gen_type precompute) instead of "
           "running a reference model"),
    _train("precompute_overwrite", bool, False, "generate.py's text_gen_type precompute replaces precompute_model_name "
           "files another model wrote (their .reference.json names it) instead of refusing to; files the same model "
           "wrote are kept either way", gpt_neox=False),
    _train("kto_beta", FLOAT, 0.1, "KTO's beta"),
    _train("kto_fp32", bool, True, "KTO: cast the logits to fp32 before taking log-probabilities"),
    _train("kto_desirable_weight", FLOAT, 1.0, "KTO: the weight of samples whose reward is above 0"),
    _train("kto_undesirable_weight", FLOAT, 1.0, "KTO: the weight of samples whose reward is below 0"),
    _train("reinforce_leave_one_out", bool, False, "train_impl reinforce: the advantage of a completion is its "
           "reward minus the mean reward of the other completions of its prompt (RLOO); false: minus the moving "
           "average of the last 100 groups' mean rewards (GPT-NeoX's two modes; reinforce_advantage names them)"),
    _train("reinforce_advantage", OPT_STR, None, "train_impl reinforce: moving_average, leave_one_out or "
           "group_normalized (GRPO: (r - mean) / (std + 1e-4) over the prompt's completions, unbiased std, TRL's "
           "default scaling); unset: what reinforce_leave_one_out says",
           choices=(None, "moving_average", "leave_one_out", "group_normalized"), gpt_neox=False),
    _train("fp32_reinforce", bool, True, "train_impl reinforce: cast the logits to fp32 before taking "
           "log-probabilities"),
    _train("kl_impl", str, "mse", "train_impl reinforce: the KL penalty per token, from the policy's and the "
           "reference's log-probabilities of the token: abs |lp - rp|, mse (lp - rp)^2 / 2, kl lp - rp, or full "
           "(the exact KL over the whole vocabulary)", choices=("abs", "mse", "kl", "full")),
    _train("kl_div_beta", FLOAT, 0.1, "train_impl reinforce: the weight of the KL penalty; 0 builds no reference "
           "model"),
    _train("reward_function", OPT_STR, None, "train_impl reinforce: \"path/file.py:name\", the function that scores "
           "the completions sampled here, called as TRL calls one: name(prompts=[...], completions=[...], "
           "completion_ids=[...]) -> one float per completion (texts without special tokens); unset with "
           "dataset_impl online: GPT-NeoX's data server sends scored completions", gpt_neox=False),
    _train("reward_model", OPT_STR, None, "train_impl reinforce: a checkpoint directory saved by a train_impl rm "
           "run (its `latest` tag), the scorer of the completions sampled here: a completion's reward is the reward "
           "model's scalar for prompt + completion read where the rm objective trains it (the first end-of-text "
           "token after the completion). Loaded weights only and frozen; it has the policy's architecture and "
           "tokenizer, and its identity goes into every save, so a resume scores with the same model. Set one of "
           "reward_function, reward_model and dataset_impl online", gpt_neox=False),
    _train("rollout_samples_shown", int, 0, "train_impl reinforce with reward_function or reward_model: print this "
           "many of the step's completions (prompt, completion, reward; decoded) every log_interval steps, "
           "from the logging rank; 0 prints none", gpt_neox=False),
    _train("reinforce_num_completions", int, 4, "train_impl reinforce with reward_function or reward_model: completions sampled "
           "per prompt; a micro batch holds train_micro_batch_size_per_gpu prompts' completions", gpt_neox=False),
    _train("rollout_log", OPT_STR, None, "train_impl reinforce with reward_function or reward_model: append every "
           "completion trained on to this file, one JSON object a line (iteration, rank, micro_batch, group, "
           "prompt_ids, completion_ids, reward, advantage, logp, prompt, completion); a rank above 0 writes "
           "PATH.rank<N>", gpt_neox=False),
    _train("online_dataserver_ips", (str, list), "localhost", "dataset_impl online: the data server's host, or "
           "one per data-parallel rank"),
    _train("online_dataserver_ports", (int, list), 10000, "dataset_impl online: the data server's port (the same "
           "for every data-parallel rank), or one per data-parallel rank"),
    _train("lora_rank", int, 0, "LoRA (PEFT's r): train a rank-r adapter beside each targeted linear layer, "
           "the base weights frozen; 0: off, every weight trains", gpt_neox=False),
    _train("lora_alpha", FLOAT, 8, "LoRA (PEFT's lora_alpha): the adapters' output is scaled by "
           "lora_alpha / lora_rank (lora_alpha / sqrt(lora_rank) with lora_use_rslora)", gpt_neox=False),
    _train("lora_dropout", FLOAT, 0.0, "LoRA (PEFT's lora_dropout): dropout on the adapters' input", gpt_neox=False),
    _train("lora_target_modules", (list, str, type(None)), None, "LoRA (PEFT's target_modules): the Hugging Face "
           "modules adapted, named as in the HF model (Llama family: q_proj, k_proj, v_proj, o_proj, gate_proj, "
           "up_proj, down_proj; GPT-NeoX: query_key_value, dense, dense_h_to_4h, dense_4h_to_h) or all-linear; "
           "unset: PEFT's default (q_proj and v_proj; GPT-NeoX: query_key_value). With experts (moe_num_experts > 1) "
           "the attention's and the experts' fused parameters, experts.gate_up_proj and experts.down_proj (PEFT's "
           "target_parameters; an adapter pair per expert, lora_dropout 0); all-linear is the attention's",
           gpt_neox=False),
    _train("lora_use_rslora", bool, False, "LoRA (PEFT's use_rslora): scale by lora_alpha / sqrt(lora_rank)",
           gpt_neox=False),
    _train("optimizer", (dict, type(None)), None, "optimizer as {type: Adam|AdamW|SGD, params: {lr, betas, eps, ...}}"),
    _train("lr", OPT_FLOAT, None, "peak learning rate; normally given as optimizer.params.lr; unset in both: 0.001 (GPT-NeoX's Adam default)"),
    _train("min_lr", FLOAT, 0.0, "learning rate at the end of the decay"),
    _train("lr_decay_style", str, "linear", "decay after warmup", choices=("constant", "linear", "cosine", "exponential")),
    _train("lr_decay_iters", OPT_INT, None, "iterations over which the LR decays; unset means train_iters"),
    _train("lr_decay_fraction", OPT_FLOAT, None, "lr_decay_iters as a fraction of train_iters, when lr_decay_iters is unset"),
    _train("warmup", FLOAT, 0.01, "warmup length as a fraction of lr_decay_iters (0.01: the first 1%)"),
    _train("override_lr_scheduler", bool, False, "on resume, take the LR schedule from the configs even where the checkpoint's differs"),
    _train("use_checkpoint_lr_scheduler", bool, False, "on resume, take the LR schedule from the checkpoint, ignoring the configs"),
    _train("weight_decay", FLOAT, 0.1, "weight decay (not applied to biases and norm weights)"),
    _train("gradient_clipping", FLOAT, 1.0, "clip the global gradient norm to this (0 disables)"),
    _train("train_iters", OPT_INT, None, "number of training iterations"),
    _train("train_micro_batch_size_per_gpu", OPT_INT, None, "samples per rank per forward pass"),
    _train("gradient_accumulation_steps", OPT_INT, None, "micro batches per optimizer step"),
    _train("train_batch_size", OPT_INT, None, "samples per optimizer step across all ranks"),
    _train("zero_optimization", (dict, type(None)), None, "DeepSpeed ZeRO settings, e.g. {stage: 2}"),
    _train("fp16", (dict, type(None)), None, "DeepSpeed fp16 settings, e.g. {enabled: true, loss_scale: 0}"),
    _train("bf16", (dict, type(None)), None, "DeepSpeed bf16 settings, e.g. {enabled: true}"),
    _train("precision", OPT_STR, None, "training dtype; derived from fp16/bf16 when unset", choices=("fp32", "fp16", "bf16", None)),
    _train("max_nonfinite_steps", int, 20, "fp16: stop the run after more than this many steps in a row skipped for overflowing gradients (bf16/fp32 stop at the first non-finite step)", gpt_neox=False),
    _train("seed", int, 1234, "random seed (weights, data order, dropout)"),
    _train("torch_compile", bool, False, "compile the model with torch.compile through DeepSpeed's engine.compile (the first steps take the compile time)", gpt_neox=False),
    _train("deepspeed_extra_args", (dict, type(None)), None, "DeepSpeed config keys passed through unchanged"),
    _train("fp32_allreduce", bool, False, "reduce gradients across ranks in fp32 (DeepSpeed's communication_data_type: fp32)"),
    # --- DeepSpeed config keys (written into the DeepSpeed config when not at their default) ----

    _ds("prescale_gradients", bool, False, "scale gradients before the all-reduce instead of after"),
    _ds("gradient_predivide_factor", FLOAT, 1.0, "divide gradients by this before the all-reduce, the rest after"),
    _ds("sparse_gradients", bool, False, "reduce embedding gradients as sparse tensors"),
    _ds("communication_data_type", OPT_STR, None, "dtype of gradient communication (DeepSpeed's communication_data_type)"),
    _ds("data_types", (dict, type(None)), None, "DeepSpeed data_types section, e.g. {grad_accum_dtype: fp32}"),
    _ds("flops_profiler", (dict, type(None)), None, "DeepSpeed flops_profiler section"),
    _ds("comms_logger", (dict, type(None)), None, "DeepSpeed comms_logger section"),
    _ds("csv_monitor", (dict, type(None)), None, "DeepSpeed csv_monitor section"),
    _ds("dump_state", bool, False, "DeepSpeed prints its engine state after initialisation"),
    _ds("zero_allow_untested_optimizer", bool, False, "let ZeRO run an optimizer DeepSpeed has not tested with it (SGD)", gpt_neox=False),
    # --- evaluation and logging -----------------------------------------------------------
    _log("eval_interval", int, 1000, "evaluate on the validation split every this many iterations"),
    _log("eval_iters", int, 100, "validation batches per evaluation"),
    _log("log_interval", int, 100, "print a training line every this many iterations"),
    _log("steps_per_print", int, 10, "DeepSpeed's own print interval"),
    _log("tensorboard_dir", OPT_STR, None, "write TensorBoard scalars here"),
    _log("log_dir", OPT_STR, None, "write text logs here"),
    _log("log_grad_norm", bool, False, "write each parameter's gradient norm to TensorBoard/W&B every step (gradient_norms/<name>)"),
    _log("moe_collapse_token_share", FLOAT, 0.9, "with experts: a layer's router counts as collapsed onto an expert that gets more than this share of the layer's tokens (its share of the routed slots x moe_top_k), see megatron/objectives/expert_load.py", gpt_neox=False),
    _log("moe_collapse_steps", int, 50, "with experts: say in one line when a layer's router stays collapsed onto one expert (moe_collapse_token_share) for this many steps in a row", gpt_neox=False),
    _log("log_param_norm", bool, False, "write each parameter's norm to TensorBoard/W&B every step (parameter_norms/<name>)"),
    _log("profile", bool, False, "record a torch.profiler trace of steps profile_step_start..profile_step_stop into tensorboard_dir"),
    _log("profile_step_start", int, 10, "first step the profiler records"),
    _log("profile_step_stop", int, 12, "step after which the profiler stops"),
    _log("memory_profiling", bool, False, "record CUDA allocations and save a snapshot (mem_snapshot.pickle) in memory_profiling_path during the profiled steps"),
    _log("memory_profiling_path", OPT_STR, None, "folder for the memory snapshot"),
    _log("use_wandb", (bool, type(None)), None, "log to Weights & Biases (when installed)"),
    _log("wandb_project", OPT_STR, "neox", "W&B project"),
    _log("wandb_group", OPT_STR, None, "W&B group"),
    _log("wandb_run_name", OPT_STR, None, "W&B run name"),
    # --- text generation (generate.py) ----------------------------------------------------
    _gen("text_gen_type", OPT_STR, None, "what generate.py does: sample without a prompt, complete each prompt of sample_input_file, or ask for prompts", choices=("unconditional", "input-file", "interactive", "precompute", None)),
    _gen("temperature", FLOAT, 0.0, "divide the logits by this before sampling; 0 with top_k 0 and top_p 0 is greedy (the most likely token)"),
    _gen("top_p", FLOAT, 0.0, "sample from the smallest set of tokens whose probabilities add up to more than this (0: off)"),
    _gen("top_k", int, 0, "sample from the this many most likely tokens (0: off)"),
    _gen("maximum_tokens", int, 64, "tokens to generate at most per prompt (fewer when prompt + tokens would pass seq_length)"),
    _gen("prompt_end", str, "\n", "what separates the prompts of sample_input_file (and ends an interactive prompt)"),
    _gen("sample_input_file", OPT_STR, None, "input-file: the prompts, separated by prompt_end"),
    _gen("sample_output_file", OPT_STR, "samples.txt", "where generate.py writes its samples: one JSON object a line (context, text, ...)"),
    _gen("num_samples", int, 1, "unconditional: how many samples to generate"),
    _gen("recompute", bool, False, "run the whole sequence through the model for every token instead of keeping the keys and values of earlier tokens"),
    # --- evaluation with the LM Evaluation Harness (eval.py) ------------------------------
    _eval("eval_tasks", (list, type(None)), None, "the harness's tasks (names or glob patterns) eval.py scores the model on (deepy.py's --eval_tasks)"),
    _eval("eval_results_prefix", str, "", "eval.py writes its results to <eval_results_prefix>_eval_results_<date-time>.json (without the prefix and its _ when empty)"),
    _eval("eval_include_path", (str, list, type(None)), None, "directories of task YAML files the harness loads besides its own (local tasks; nothing downloaded)", gpt_neox=False),
    _eval("eval_num_fewshot", int, 0, "examples put before each question of every task that allows them (GPT-NeoX's eval.py: 0)", gpt_neox=False),
    _eval("eval_bootstrap_iters", int, 10000, "bootstrap resamples for the standard errors of metrics with no closed form (0: none; GPT-NeoX's eval.py: 10000)", gpt_neox=False),
    # --- checkpointing -------------------------------------------------------------------
    _ckpt("save", OPT_STR, None, "directory to save checkpoints to"),
    _ckpt("load", OPT_STR, None, "checkpoint directory to load from"),
    _ckpt("checkpoint_factor", OPT_INT, None, "save every this many iterations (GPT-NeoX name)"),
    _ckpt("extra_save_iters", (list, type(None)), None, "also save at these iterations (0: before the first step)"),
    _ckpt("save_interval", OPT_INT, None, "alias of checkpoint_factor", gpt_neox=False),
    _ckpt("keep_last_n_checkpoints", OPT_INT, None, "delete older checkpoint tags, keeping this many"),
    _ckpt("finetune", bool, False, "load weights only; fresh optimizer, iteration 0, no RNG restore"),
    _ckpt("no_load_optim", bool, False, "load weights, iteration and RNG; fresh optimizer and LR schedule"),
    _ckpt("no_load_rng", bool, False, "do not restore RNG states"),
    _ckpt("no_save_optim", bool, False, "save weights without optimizer states; a resume of such a tag starts a fresh optimizer"),
    _ckpt("async_save", bool, True, "a save copies the state to host memory and training goes on while a background "
          "thread writes, checksums and commits the tag; the next save and the run's end wait for it", gpt_neox=False),
    _ckpt("iteration", OPT_INT, None, "load tag global_step<iteration> instead of the one in `latest`"),
    _ckpt("load_module_strict", bool, True, "every checkpoint key must match the model exactly", gpt_neox=False),
    _ckpt("load_module_allow_random", (list, type(None)), None,
          "with load_module_strict false: glob patterns of parameter names whose whole layer may stay randomly initialised", gpt_neox=False),
    _ckpt("checkpoint_validation_with_forward_pass", bool, False, "store logits of a fixed batch at save and compare after load"),
    # --- data ----------------------------------------------------------------------------
    _data("data_path", OPT_STR, None, "prefix of one .bin/.idx dataset, split by `split`"),
    _data("train_data_paths", (list, type(None)), None, "prefixes of training datasets"),
    _data("valid_data_paths", (list, type(None)), None, "prefixes of validation datasets"),
    _data("test_data_paths", (list, type(None)), None, "prefixes of test datasets"),
    _data("train_data_weights", (list, type(None)), None, "blending weights of train_data_paths"),
    _data("valid_data_weights", (list, type(None)), None, "blending weights of valid_data_paths"),
    _data("test_data_weights", (list, type(None)), None, "blending weights of test_data_paths"),
    _data("split", str, "969, 30, 1", "train, valid, test proportions of data_path"),
    _data("train_label_data_paths", (list, type(None)), None,
          "label files of train_data_paths (token ids, negative where the loss is masked), one per path"),
    _data("valid_label_data_paths", (list, type(None)), None, "label files of valid_data_paths, one per path"),
    _data("test_label_data_paths", (list, type(None)), None, "label files of test_data_paths, one per path"),
    _data("dataset_impl", str, "gpt2", "gpt2 (documents of train_data_paths) or pairwise (chosen document k of "
          "pos_*_data_paths with rejected document k of neg_*_data_paths, for dpo and rm) or online (train_impl "
          "reinforce: completions sampled here, or scored ones from GPT-NeoX's data server)",
          choices=("gpt2", "pairwise", "online")),
    *(_data(f"{split}_reward_data_paths", (list, type(None)), None,
            f"reward files of {split}_data_paths (one value per document, pack_impl unpacked or pack_until_overflow), one per path")
      for split in ("train", "valid", "test")),
    *(_data(f"{sign}_{split}_{kind}data_paths", (list, type(None)), None,
            f"{'label files of ' if kind else ''}{'chosen' if sign == 'pos' else 'rejected'} {split} documents"
            f"{f' ({sign}_{split}_data_paths), one per path' if kind else ' (dataset_impl pairwise)'}")
      for split in ("train", "valid", "test") for sign in ("pos", "neg") for kind in ("", "label_")),
    _data("pack_impl", str, "packed", "how documents become samples: packed, pack_until_overflow (whole documents "
          "until the next would overflow) or unpacked (one document per sample)",
          choices=("packed", "pack_until_overflow", "unpacked")),
    _data("eod_mask_loss", bool, False, "do not train the positions whose input token is the tokenizer's eod"),
    _data("reset_position_ids", bool, False, "Megatron-LM's: positions start again at 0 after every eod token "
          "(packed pairs: at each pair's document, as the dataset marks it); packed pairs need it", gpt_neox=False),
    _data("reset_attention_mask", bool, False,
          "Megatron-LM's: a token attends only to its own document (documents end with the eod token; packed pairs: "
          "the documents the dataset marks); packed pairs need it", gpt_neox=False),
    _data("allow_chopped", bool, True, "with pack_impl other than packed: keep documents longer than seq_length + 1 "
          "(cut to it); false skips them"),
    _data("data_impl", str, "infer", "dataset format: infer reads it from the .idx header; only mmap files exist here", choices=("infer", "mmap")),
    _data("tokenizer_type", str, "GPT2BPETokenizer", "tokenizer (megatron/tokenizer)",
          choices=("GPT2BPETokenizer", "HFTokenizer", "SPMTokenizer", "CharLevelTokenizer", "ByteLevelTokenizer")),
    _data("vocab_file", OPT_STR, None,
          "tokenizer file: vocab.json (GPT2BPETokenizer), tokenizers JSON (HFTokenizer), sentencepiece model (SPMTokenizer)"),
    _data("merge_file", OPT_STR, None, "merges.txt of GPT2BPETokenizer"),
    _data("embedded_corpus", bool, False, "build (once, cached) and use the embedded corpus that needs no download", gpt_neox=False),
    _data("num_workers", int, 2, "data-loader worker processes"),
    # --- launcher ------------------------------------------------------------------------
    _launch("num_gpus", OPT_INT, None, "ranks per node (CPU ranks when there is no GPU; default 1 then)"),
    _launch("num_nodes", OPT_INT, -1, "number of nodes; -1: every host of the hostfile"),
    _launch("hostfile", OPT_STR, None, "DeepSpeed hostfile"),
    _launch("include", OPT_STR, None, "DeepSpeed --include host/slot filter"),
    _launch("exclude", OPT_STR, None, "DeepSpeed --exclude host/slot filter"),
    _launch("master_port", int, 29500, "rendezvous port"),
    _launch("master_addr", OPT_STR, None, "rendezvous address"),
    _launch("launcher", str, "pdsh", "multi-node launcher", choices=("pdsh", "openmpi", "mvapich", "slurm", "mpich", "impi")),  # DeepSpeed's runners (jsrun is DeeperSpeed's)
    _launch("node_rank", OPT_INT, None, "start only this node's ranks, those of the hostfile's node_rank-th host, without ssh (DeepSpeed's --no_ssh --node_rank, as torchrun's): run deepy.py on every node with its own node_rank, one hostfile and master_addr", gpt_neox=False),
    _launch("deepspeed_slurm", bool, False, "ranks started by SLURM (srun): rank and world size come from SLURM's environment"),
    _launch("deepspeed_mpi", bool, False, "ranks started by MPI: rank and world size come from the MPI environment"),
    # --- derived (set by the loader, never by a YAML) -------------------------------------
    _derived("padded_vocab_size", OPT_INT, None, "vocabulary size padded to make_vocab_size_divisible_by", derived=True),
    _derived("config_files", (dict, type(None)), None, "the YAML files the run was started with: name -> text", derived=True),
    _derived("zero_stage", int, 0, "ZeRO stage, from zero_optimization.stage", derived=True),
    _launch("global_num_gpus", OPT_INT, None, "ranks in the whole run; derived from num_gpus x num_nodes or hostfile/include/exclude, and an error when set to anything else"),
    _derived("data_parallel_size", OPT_INT, None, "data-parallel ranks: global_num_gpus / (model_parallel_size x context_parallel_size x pipeline stages)", derived=True, gpt_neox=False),
    _derived("warmup_iters", OPT_FLOAT, None, "warmup length in iterations: warmup x lr_decay_iters (not rounded)", derived=True, gpt_neox=False),
]

SETTINGS: dict[str, Setting] = {s.name: s for s in SETTINGS_LIST}
