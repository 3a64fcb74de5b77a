"""Every setting shared with GPT-NeoX has GPT-NeoX's default.

The table holds GPT-NeoX's defaults as written in its megatron/neox_arguments/neox_args.py and
deepspeed_args.py (facts copied by hand, not read from this project's code).
"""

import pytest

from megatron.neox_arguments import SETTINGS

GPT_NEOX_DEFAULTS = {
    # parallelism and model
    "pipe_parallel_size": 0,
    "pipe_partition_method": "type:transformer|mlp",
    "model_parallel_size": 1,
    "num_layers": None,
    "hidden_size": None,
    "intermediate_size": None,
    "mlp_multiple_of": 1,
    "num_attention_heads": None,
    "num_kv_heads": None,
    "seq_length": None,
    "sliding_window_width": None,
    "max_position_embeddings": None,
    "norm": "layernorm",
    "layernorm_epsilon": 1.0e-5,
    "rms_norm_epsilon": 1.0e-8,
    "pos_emb": "learned",
    "no_weight_tying": False,
    "make_vocab_size_divisible_by": 128,
    "activation": "gelu",
    "bias_gelu_fusion": False,
    "onnx_safe": False,
    "init_method_std": 0.02,
    "rotary_pct": 1.0,
    "rotary_emb_base": 10000,
    "init_method": "normal",
    "output_layer_init_method": "scaled_normal",
    "gpt_j_residual": False,
    "moe_num_experts": 1,
    "moe_expert_interval": 1,
    "moe_top_k": 1,
    "moe_router_type": "sinkhorn",
    "use_bias_in_norms": True,
    "use_bias_in_attn_linear": True,
    "use_bias_in_mlp": True,
    "precision": None,
    # optimizer and LR schedule
    "lr": None,
    "lr_decay_style": "linear",
    "lr_decay_iters": None,
    "lr_decay_fraction": None,
    "min_lr": 0.0,
    "warmup": 0.01,
    "override_lr_scheduler": False,
    "use_checkpoint_lr_scheduler": False,
    # logging
    "use_wandb": None,
    "wandb_group": None,
    "wandb_run_name": None,
    "wandb_project": "neox",
    "log_dir": None,
    "tensorboard_dir": None,
    "log_interval": 100,
    "log_param_norm": False,
    "log_grad_norm": False,
    "memory_profiling": False,
    "memory_profiling_path": None,
    "profile": False,
    "profile_step_start": 10,
    "profile_step_stop": 12,
    # other
    "seed": 1234,
    "deepspeed_mpi": False,
    "deepspeed_slurm": False,
    "iteration": None,
    "global_num_gpus": None,
    "padded_vocab_size": None,
    # data, checkpoints, training
    "data_path": None,
    "train_data_paths": None,
    "test_data_paths": None,
    "valid_data_paths": None,
    "train_label_data_paths": None,
    "valid_label_data_paths": None,
    "test_label_data_paths": None,
    "pack_impl": "packed",
    "allow_chopped": True,
    "eod_mask_loss": False,
    "train_data_weights": None,
    "valid_data_weights": None,
    "test_data_weights": None,
    "data_impl": "infer",
    "save": None,
    "config_files": None,
    "load": None,
    "checkpoint_validation_with_forward_pass": False,
    "checkpoint_factor": None,
    "extra_save_iters": None,
    "no_load_optim": False,
    "no_load_rng": False,
    "finetune": False,
    "train_iters": None,
    "eval_iters": 100,
    "keep_last_n_checkpoints": None,
    "eval_interval": 1000,
    "split": "969, 30, 1",
    "vocab_file": None,
    "merge_file": None,
    "tokenizer_type": "GPT2BPETokenizer",
    "num_workers": 2,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "weight_decay": 0.1,
    "checkpoint_activations": False,
    # text generation (NeoXArgsTextgen)
    "text_gen_type": None,
    "temperature": 0.0,
    "top_p": 0.0,
    "top_k": 0,
    "maximum_tokens": 64,
    "prompt_end": "\n",
    "sample_input_file": None,
    "sample_output_file": "samples.txt",
    "num_samples": 1,
    "recompute": False,
    # DeepSpeed config (deepspeed_args.py)
    "train_batch_size": None,
    "train_micro_batch_size_per_gpu": None,
    "optimizer": None,
    "fp32_allreduce": False,
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "sparse_gradients": False,
    "fp16": None,
    "bf16": None,
    "gradient_clipping": 1.0,
    "zero_optimization": None,
    "steps_per_print": 10,
    "dump_state": False,
    "flops_profiler": None,
    "communication_data_type": None,
    "comms_logger": None,
    "csv_monitor": None,
    "data_types": None,
    "deepspeed_extra_args": None,
    # DeepSpeed launcher (deepspeed_args.py)
    "hostfile": None,
    "include": None,
    "exclude": None,
    "num_nodes": -1,
    "num_gpus": None,
    "master_port": 29500,
    "master_addr": None,
    "launcher": "pdsh",
}


@pytest.mark.parametrize("name", sorted(GPT_NEOX_DEFAULTS))
def test_shared_setting_has_gpt_neox_default(name):
    assert name in SETTINGS, f"{name} is a GPT-NeoX setting missing from the schema"
    assert SETTINGS[name].default == GPT_NEOX_DEFAULTS[name]


def test_gradient_accumulation_default_is_one_step_as_in_gpt_neox(tmp_path):
    # GPT-NeoX's default is 1; ours is unset so that train_batch_size may decide it, and 1 otherwise
    from megatron.neox_arguments import NeoXArgs

    args = NeoXArgs.from_dict({"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 4,
                               "train_micro_batch_size_per_gpu": 3})
    assert args.gradient_accumulation_steps == 1 and args.train_batch_size == 3


def test_a_gpt_neox_name_is_either_a_setting_or_handled_as_foreign_never_both():
    from megatron.neox_arguments.foreign import ALIASES, INERT, TENSOR_PARALLEL_ONLY, UNSUPPORTED

    tables = (INERT, UNSUPPORTED, ALIASES, TENSOR_PARALLEL_ONLY)
    for table in tables:
        assert not set(table) & set(SETTINGS)
    for i, table in enumerate(tables):
        for other in tables[i + 1:]:
            assert not set(table) & set(other)
