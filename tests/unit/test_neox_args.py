"""Loading, merging, validating and deriving settings (megatron.neox_arguments)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron.neox_arguments import ConfigError, NeoXArgs, load_args_on_rank, padded_vocab_size
from megatron.neox_arguments.handover import handover_argv

TINY_RUN = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "train_iters": 100,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    "train_micro_batch_size_per_gpu": 2,
    "embedded_corpus": True,
}


def write_yaml(directory: Path, name: str, values: dict | str) -> Path:
    path = directory / name
    path.write_text(values if isinstance(values, str) else yaml.safe_dump(values, sort_keys=False))
    return path


def run_args(tmp_path, **overrides) -> NeoXArgs:
    path = write_yaml(tmp_path, "run.yml", {**TINY_RUN, **overrides})
    return NeoXArgs.from_yaml_files([path])


def config_error(tmp_path, **overrides) -> str:
    with pytest.raises(ConfigError) as caught:
        run_args(tmp_path, **overrides)
    return str(caught.value)


# --- loading and merging -------------------------------------------------------------------

def test_gpt_neox_dialect_braces_comments_and_dashes(tmp_path):
    text = """
    # a GPT-NeoX style file
    {
      "num-layers": 3,   # dashes
      "hidden_size": 64,
      "num-attention-heads": 4,
      "seq-length": 16,
      "train-iters": 10,
      "optimizer": {"type": "Adam", "params": {"lr": 1.0e-3}},
      "train-micro-batch-size-per-gpu": 1,
      "embedded-corpus": true,
      "layernorm-epsilon": 1e-6,
    }
    """
    args = NeoXArgs.from_yaml_files([write_yaml(tmp_path, "neox.yml", text)])
    assert args.num_layers == 3 and args.seq_length == 16 and args.embedded_corpus is True
    assert args.layernorm_epsilon == pytest.approx(1e-6)  # "1e-6" is a string to YAML 1.1; read as float


def test_later_files_override_key_by_key_and_sources_are_recorded(tmp_path):
    base = write_yaml(tmp_path, "base.yml", {**TINY_RUN, "zero_optimization": {"stage": 2, "overlap_comm": True}})
    overlay = write_yaml(tmp_path, "overlay.yml", {"num-layers": 5, "zero_optimization": {"stage": 1}})
    args = NeoXArgs.from_yaml_files([base, overlay])
    assert args.num_layers == 5
    assert args.hidden_size == 64
    # nested dicts are replaced as a whole, as in GPT-NeoX
    assert args.zero_optimization == {"stage": 1}
    assert args.source_of("num_layers") == str(overlay)
    assert args.source_of("hidden_size") == str(base)
    assert args.source_of("seed") == "default"
    assert args.source_of("zero_stage") == "derived"
    assert set(args.config_files) == {"base.yml", "overlay.yml"}
    assert args.config_files["overlay.yml"] == overlay.read_text()


def test_later_data_source_replaces_earlier_one(tmp_path):
    model = write_yaml(tmp_path, "model.yml", TINY_RUN)  # embedded_corpus: true
    local = write_yaml(tmp_path, "local.yml", {"data_path": "data/mine_text_document", "vocab_file": "tok.json",
                                               "tokenizer_type": "HFTokenizer"})
    args = NeoXArgs.from_yaml_files([model, local])
    assert args.data_path == "data/mine_text_document" and args.embedded_corpus is False


def test_two_data_sources_in_one_file_is_an_error(tmp_path):
    message = config_error(tmp_path, data_path="data/x_text_document", vocab_file="t.json")
    assert "run.yml: data_path" in message and "run.yml: embedded_corpus" in message


def test_same_key_with_dash_and_underscore_in_one_file_is_an_error(tmp_path):
    path = write_yaml(tmp_path, "twice.yml", {**TINY_RUN, "seq-length": 64})
    with pytest.raises(ConfigError, match=r"twice.yml: key 'seq_length' is set twice"):
        NeoXArgs.from_yaml_files([path])


def test_config_path_falls_back_to_configs_directory():
    args = NeoXArgs.from_yaml_files(["pythia/160M.yml"])
    assert args.hidden_size == 768


def test_missing_config_file_names_both_places(tmp_path):
    with pytest.raises(ConfigError, match="nope.yml.*not found"):
        NeoXArgs.from_yaml_files([tmp_path / "nope.yml"])


def test_from_dict_validates_with_the_same_rules():
    args = NeoXArgs.from_dict({**TINY_RUN, "seq-length": 48}, source="unit-test", require_run_settings=True)
    assert args.seq_length == 48 and args.source_of("seq_length") == "unit-test"
    with pytest.raises(ConfigError, match="unit-test: hiden_size: unknown setting; did you mean 'hidden_size'"):
        NeoXArgs.from_dict({**TINY_RUN, "hiden_size": 64}, source="unit-test")


def test_from_dict_accepts_a_model_only_dict_but_a_run_needs_more():
    model_only = {key: TINY_RUN[key] for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")}
    args = NeoXArgs.from_dict({**model_only, "padded_vocab_size": 256})
    assert args.padded_vocab_size == 256 and args.architecture().intermediate_size == 4 * 64
    with pytest.raises(ConfigError, match="train_iters: required"):
        NeoXArgs.from_dict(model_only, require_run_settings=True)
    with pytest.raises(ConfigError, match="no DeepSpeed config without train_batch_size and lr"):
        args.deepspeed_config()


def test_tensor_parallel_ranks_leave_the_rest_to_data_parallelism(tmp_path):
    args = run_args(tmp_path, num_gpus=4, model_parallel_size=2, train_micro_batch_size_per_gpu=2,
                    gradient_accumulation_steps=1)
    assert (args.global_num_gpus, args.data_parallel_size, args.train_batch_size) == (4, 2, 4)
    assert padded_vocab_size(50277, 128, 2) == 50432  # each of the 2 shards a multiple of 128 rows


def test_settings_are_read_only_after_validation(tmp_path):
    args = run_args(tmp_path)
    with pytest.raises(AttributeError, match="read-only after validation: cannot set 'hidden_size'"):
        args.hidden_size = 256
    with pytest.raises(AttributeError, match="read-only"):
        args.padded_vocab_size = 64
    assert args.hidden_size != 256 and args.padded_vocab_size is None
    with pytest.raises(TypeError, match="built by validation"):
        NeoXArgs({"hidden_size": 8})


def test_with_values_validates_again_and_leaves_the_original_alone(tmp_path):
    args = run_args(tmp_path)
    resolved = args.with_values({"padded_vocab_size": padded_vocab_size(50277, 128, 1)}, "tokenizer x.json")
    assert (resolved.padded_vocab_size, resolved.source_of("padded_vocab_size")) == (50304, "tokenizer x.json")
    assert args.padded_vocab_size is None and resolved.source_of("hidden_size") == args.source_of("hidden_size")
    with pytest.raises(ConfigError, match="hidden_size"):
        args.with_values({"hidden_size": 66}, "test")  # not divisible by the heads: validation ran again


def test_a_yaml_may_not_set_what_code_gives(tmp_path):
    path = write_yaml(tmp_path, "vocab.yml", {**TINY_RUN, "padded_vocab_size": 64})
    with pytest.raises(ConfigError, match="padded_vocab_size: is derived"):
        NeoXArgs.from_yaml_files([path])


def test_saved_settings_of_other_programs_restore_what_this_schema_knows():
    saved = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 4, "padded_vocab_size": 64,
             "num_gpus": 8, "train_batch_size": 512, "data_parallel_size": 8, "global_num_gpus": 8,
             "some_other_programs_key": 1, "bias_gelu_fusion": True, "hostfile": "/nowhere/hostfile"}
    args = NeoXArgs.from_saved(saved, "ckpt/global_step5")
    assert (args.num_layers, args.padded_vocab_size, args.train_batch_size) == (2, 64, None)
    assert args.source_of("num_layers") == "ckpt/global_step5"
    experts = NeoXArgs.from_saved({**saved, "moe_num_experts": 8}, "ckpt")
    assert experts.architecture().moe_router_type == "sinkhorn"  # GPT-NeoX's default router


# --- validation errors name the file and the key ----------------------------------------------

@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"num_layerz": 2}, r"run.yml: num_layerz: unknown setting; did you mean 'num_layers'\?"),
        ({"hidden_size": "wide"}, r"run.yml: hidden_size: expected int, got 'wide'"),
        ({"num_layers": True}, r"run.yml: num_layers: expected int, got True"),
        ({"train_iters": 10.5}, r"run.yml: train_iters: expected int or null, got 10.5"),
        ({"norm": "layer_norm"}, r"run.yml: norm: 'layer_norm' is not one of 'layernorm', 'rmsnorm'"),
        ({"norm": "scalenorm"}, r"run.yml: norm: 'scalenorm': ScaleNorm is a GPT-NeoX feature not built here"),
        ({"pos_emb": "alibi"}, r"run.yml: pos_emb: 'alibi': ALiBi position bias is a GPT-NeoX feature not built"),
        ({"tokenizer_type": "TiktokenTokenizer", "vocab_file": "cl100k_base"},
         r"run.yml: tokenizer_type: 'TiktokenTokenizer': TiktokenTokenizer, which downloads its encoding"),
        ({"tokenizer_type": "HFGPT2Tokenizer"}, r"run.yml: tokenizer_type: 'HFGPT2Tokenizer': .*use GPT2BPETokenizer"),
        ({"activation": "geglu"}, r"run.yml: activation: 'geglu': the geglu activation is a GPT-NeoX feature"),
        ({"data_impl": "cached"}, r"run.yml: data_impl: 'cached': the legacy cached indexed-dataset format"),
        ({"hidden_size": 66}, r"run.yml: hidden_size \(66\) is not divisible by run.yml: num_attention_heads \(4\)"),
        ({"num_kv_heads": 3}, r"run.yml: num_attention_heads \(4\) is not divisible by run.yml: num_kv_heads \(3\)"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"run.yml: fp16 and run.yml: bf16: both enabled"),
        ({"precision": "fp32", "bf16": {"enabled": True}}, r"run.yml: precision: 'fp32' contradicts"),
        ({"train_batch_size": 5, "gradient_accumulation_steps": 2},
         r"run.yml: train_batch_size \(5\) != run.yml: train_micro_batch_size_per_gpu \(2\) x "
         r"run.yml: gradient_accumulation_steps \(2\) x data_parallel_size \(1\)"),
        ({"train_batch_size": 7}, r"run.yml: train_batch_size \(7\) is not a multiple of run.yml: "
                                  r"train_micro_batch_size_per_gpu \(2\)"),
        ({"embedded_corpus": False}, r"no training data; set data_path"),
        ({"zero_stage": 2}, r"run.yml: zero_stage: is derived .* remove it"),
        ({"padded_vocab_size": 512}, r"run.yml: padded_vocab_size: is derived"),
        ({"config_files": {}}, r"run.yml: config_files: is derived"),
        ({"lr": 0.01}, r"run.yml: lr is 0.01 but optimizer.params.lr is 0.001"),
        ({"optimizer": {"type": "Lion", "params": {"lr": 1}}}, r"run.yml: optimizer: type 'Lion' is not supported"),
        ({"zero_optimization": {"stage": 4}}, r"run.yml: zero_optimization: stage must be 0, 1, 2 or 3"),
        ({"zero_optimization": {"stage": 1, "overlap_com": True}},
         r"run.yml: zero_optimization.overlap_com: not a key of DeepSpeed's zero_optimization section"),
        ({"model_parallel_size": 2}, r"run.yml: model_parallel_size: 2 does not divide the 1 ranks"),
        ({"model_parallel_size": 3, "num_gpus": 3, "hidden_size": 66, "num_attention_heads": 6, "num_kv_heads": 2},
         r"run.yml: model_parallel_size: num_kv_heads=2 neither divides nor is divisible by model_parallel_size=3"),
        ({"model_parallel_size": 0}, r"run.yml: model_parallel_size: must be at least 1"),
        ({"pipe_parallel_size": 2}, r"run.yml: pipe_parallel_size: 2 stages x model_parallel_size 1 = 2 ranks per "
         r"model replica do not divide the 1 ranks"),
        ({"pipe_parallel_size": -1}, r"run.yml: pipe_parallel_size: must not be negative"),
        ({"pipe_parallel_size": 2, "num_gpus": 2, "zero_optimization": {"stage": 2}},
         r"run.yml: zero_optimization: stage 2 with pipe_parallel_size 2: DeepSpeed's pipe engine runs ZeRO stage 0 "
         r"or 1 only"),
        ({"pipe_parallel_size": 2, "num_gpus": 2, "log_grad_norm": True},
         r"run.yml: log_grad_norm: not available with pipe_parallel_size 2"),
        ({"pipe_partition_method": "type:"}, r"run.yml: pipe_partition_method: 'type:' is not one of 'uniform'"),
        ({"hidden_dropout": 1.5}, r"run.yml: hidden_dropout: must be in \[0, 1\)"),
        ({"warmup": 2.5}, r"run.yml: warmup: 2.5: warmup is a fraction of lr_decay_iters \(as in GPT-NeoX\)"),
        ({"override_lr_scheduler": True, "use_checkpoint_lr_scheduler": True},
         r"run.yml: override_lr_scheduler and \S*run.yml: use_checkpoint_lr_scheduler: both set"),
        ({"lr_decay_fraction": 1.5}, r"run.yml: lr_decay_fraction: must be in \(0, 1\]"),
        ({"extra_save_iters": [10, "20"]}, r"run.yml: extra_save_iters: expected a list of iteration numbers"),
        ({"global_num_gpus": 4}, r"run.yml: global_num_gpus: 4, but the launcher settings .* start 1 rank"),
        ({"sliding_window_width": 0}, r"run.yml: sliding_window_width: must be at least 1"),
        ({"profile": True}, r"run.yml: profile: the trace is written to tensorboard_dir"),
        ({"memory_profiling": True}, r"run.yml: memory_profiling: needs memory_profiling_path"),
        ({"profile": True, "tensorboard_dir": "tb", "profile_step_start": 5, "profile_step_stop": 5},
         r"profile_step_start \(5\) must be below \S*run.yml: profile_step_stop \(5\)"),
        ({"te_mha": True}, r"run.yml: te_mha: True: Transformer Engine is a GPT-NeoX feature not built here"),
        ({"attention_config": [[["mamba"], 2]]}, r"run.yml: attention_config: attention types \['mamba'\] are GPT-NeoX"),
        ({"use_comet": True}, r"run.yml: use_comet: True: Comet logging is a GPT-NeoX feature not built here"),
        ({"checkpoint_factor": 10, "save_interval": 20}, r"run.yml: checkpoint_factor \(10\) and run.yml: save_interval"),
        ({"finetune": True}, r"run.yml: finetune: set but `load` is not"),
        ({"embedded_corpus": False, "data_path": "d", "tokenizer_type": "HFTokenizer"},
         r"vocab_file \(default\): tokenizer_type HFTokenizer needs vocab_file \(a tokenizers JSON file\)"),
        ({"embedded_corpus": False, "data_path": "d", "vocab_file": "vocab.json"},
         r"merge_file \(default\): tokenizer_type GPT2BPETokenizer \(GPT-NeoX's default tokenizer_type\) needs merge_file"),
        ({"max_position_embeddings": 16}, r"run.yml: max_position_embeddings \(16\) is shorter than"),
        ({"deepspeed_extra_args": {"train_batch_size": 64}},
         r"deepspeed_extra_args: train_batch_size = 64 would override"),
        ({"deepspeed_extra_args": {"scheduler": {"type": "WarmupLR"}}}, r"deepspeed_extra_args: scheduler"),
        ({"attention_config": [[["sparse_fixed"], 2]]}, r"run.yml: attention_config: attention types \['sparse_fixed'\]"),
        ({"sparsity_config": {"block": 16}}, r"run.yml: sparsity_config: .*sparse attention is a GPT-NeoX feature"),
        ({"moe_num_experts": 8, "moe_router_type": "switch"}, r"run.yml: moe_router_type: 'switch' is not one of"),
        ({"moe_num_experts": 8, "moe_jitter_eps": 0.01}, r"run.yml: moe_jitter_eps: only the topk router jitters"),
        ({"moe_num_experts": 8, "moe_router_type": "topk", "use_bias_in_mlp": False, "moe_top_k": 9}, r"run.yml: moe_top_k: 9 experts per token"),
        ({"moe_num_experts": 6, "moe_router_type": "topk", "use_bias_in_mlp": False, "model_parallel_size": 4, "num_gpus": 4},
         r"run.yml: model_parallel_size: 6 experts \(moe_num_experts\) cannot be split evenly over 4 tensor-parallel"),
        ({"moe_num_experts": 8, "moe_router_type": "topk", "use_bias_in_mlp": False, "lora_rank": 4,
          "lora_target_modules": ["dense_h_to_4h"]},
         r"run.yml: lora_target_modules: 'dense_h_to_4h' names no linear module of this GPT-NeoX mixture-of-experts "
         r"model; use some of query_key_value, dense, or 'all-linear'"),
        ({"moe_num_experts": 8, "moe_router_type": "topk", "use_bias_in_mlp": False, "lora_rank": 4, "norm": "rmsnorm",
          "activation": "gelu", "lora_target_modules": ["experts.down_proj"]},
         r"run.yml: lora_target_modules: 'experts.down_proj' names no linear module of this GPT-NeoX mixture-of-experts "
         r"model"),  # ungated experts (GPT-NeoX-shaped): no HF model has them, nor PEFT's target_parameters
        ({"moe_num_experts": 8, "moe_intermediate_size": 0}, r"run.yml: moe_intermediate_size: must be a positive"),
        ({"moe_num_experts": 8, "moe_shared_expert_intermediate_size": -1},
         r"run.yml: moe_shared_expert_intermediate_size: must be a positive integer when set, got -1"),
        ({"qk_layernorm": True, "qk_layernorm_across_heads": True},
         r"run.yml: qk_layernorm_across_heads: qk_layernorm is set too; a query/key norm is either per head"),
        ({"qk_layernorm_across_heads": True, "norm": "layernorm", "model_parallel_size": 2, "num_gpus": 2},
         r"run.yml: norm: layernorm: qk_layernorm_across_heads splits over tensor-parallel ranks with rmsnorm only"),
        ({"qk_layernorm_across_heads": True, "norm": "rmsnorm", "num_kv_heads": 1, "model_parallel_size": 2,
          "num_gpus": 2}, r"run.yml: model_parallel_size: 2: qk_layernorm_across_heads sums the keys' squares over the "
                          r"ranks, and with fewer key/value heads \(1\) than ranks"),
        ({"moe_num_experts": 8, "moe_router_type": "topk", "moe_jitter_eps": 1.5}, r"run.yml: moe_jitter_eps: must lie in \[0, 1\)"),
        ({"moe_num_experts": 8, "moe_router_type": "topk", "use_bias_in_mlp": False,
          "zero_optimization": {"stage": 3}}, r"run.yml: zero_optimization: mixture of experts runs so far with ZeRO"),
        ({"mlp_type": "llama"}, r"run.yml: mlp_type: 'llama': .*activation: swiglu"),
        ({"num_gpus": 2, "include": "localhost:0"}, r"include/exclude cannot be combined with num_gpus"),
        ({"hostfile": "/nonexistent/hostfile", "num_nodes": 2}, r"hostfile: '/nonexistent/hostfile' does not exist"),
        ({"num_nodes": 2}, r"num_nodes: 2 nodes need a hostfile"),
        ({"lr": float("nan")}, r"run.yml: lr: nan is not a finite number"),
        ({"optimizer": {"type": "Adam", "params": {"lr": float("inf")}}},
         r"run.yml: optimizer.params.lr: inf is not a finite number"),
        ({"optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, float("nan")]}}},
         r"run.yml: optimizer.params.betas\[1\]: nan is not a finite number"),
        ({"min_lr": float("-inf")}, r"run.yml: min_lr: -inf is not a finite number"),
        ({"layernorm_epsilon": "1e400"}, r"run.yml: layernorm_epsilon: inf is not a finite number"),
        ({"fp16": {"enabled": True, "loss_scale": float("nan")}}, r"run.yml: fp16.loss_scale: nan is not a finite"),
    ],
)
def test_validation_errors(tmp_path, overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace("run.yml", r"\S*run\.yml")):
        run_args(tmp_path, **overrides)


def test_error_names_the_file_that_set_the_key(tmp_path):
    base = write_yaml(tmp_path, "base.yml", TINY_RUN)
    bad = write_yaml(tmp_path, "bad.yml", {"num_attention_heads": 5})
    with pytest.raises(ConfigError, match=r"base.yml: hidden_size \(64\) is not divisible by \S*bad.yml: num_attention_heads"):
        NeoXArgs.from_yaml_files([base, bad])


# --- GPT-NeoX settings without an effect here ------------------------------------------------

def test_inert_gpt_neox_settings_are_accepted_with_one_notice_each(tmp_path):
    inert = {
        "scaled_upper_triang_masked_softmax_fusion": True,
        "bias_dropout_fusion": True,
        "rope_fusion": False,
        "partition_activations": True,
        "synchronize_each_layer": True,
        "checkpoint_num_layers": 1,
        "attention_config": [[["global"], 2]],
        "output_layer_parallelism": "column",
        "distributed_backend": "nccl",
        "moe_lbl_in_fp32": True,
        "sparsity_config": {},
    }
    args = run_args(tmp_path, **inert)
    assert len(args.notices) == len(inert)
    for name in inert:
        assert sum(f"run.yml: {name} has no effect" in notice for notice in args.notices) == 1
    assert all("\n" not in notice for notice in args.notices)
    assert args.data_impl == "infer"


@pytest.mark.parametrize(("name", "other"), [("output_layer_parallelism", "row")])
def test_tensor_parallel_only_settings_are_refused_where_they_would_change_something(tmp_path, name, other):
    # at model_parallel_size 1 GPT-NeoX's setting changes nothing, as in GPT-NeoX: a notice
    args = run_args(tmp_path, **{name: other})
    assert [notice for notice in args.notices if f"{name} has no effect" in notice and "model_parallel_size is 1" in notice]
    # above 1 a value other than the one built here is one line, naming the file, the key and the way out
    message = config_error(tmp_path, **{name: other}, model_parallel_size=2, num_gpus=2)
    assert "run.yml: " + name in message and "not built here" in message and "\n" not in message
    built = {"output_layer_parallelism": "column"}[name]
    args = run_args(tmp_path, **{name: built}, model_parallel_size=2, num_gpus=2)
    assert args.model_parallel_size == 2 and sum(f"{name} has no effect" in notice for notice in args.notices) == 1


def test_sequence_parallel_is_built_and_needs_a_sequence_the_ranks_share_equally(tmp_path):
    def splits(**more) -> bool:
        return NeoXArgs.from_dict({**TINY_RUN, "sequence_parallel": True, "padded_vocab_size": 128, **more}
                                  ).architecture().splits_sequence
    assert splits(model_parallel_size=2, num_gpus=2)
    assert not splits()  # one rank: nothing to split, and the run says so
    one_rank = run_args(tmp_path, sequence_parallel=True)
    assert [n for n in one_rank.notices if "sequence_parallel" in n] == [
        f"notice: {tmp_path / 'run.yml'}: sequence_parallel has no effect here (only matters at a tensor-parallel "
        "size above 1, and model_parallel_size is 1)"]
    assert not [n for n in run_args(tmp_path, sequence_parallel=True, model_parallel_size=2, num_gpus=2).notices
                if "sequence_parallel" in n]
    message = config_error(tmp_path, sequence_parallel=True, model_parallel_size=2, num_gpus=2, seq_length=33)
    assert "run.yml: sequence_parallel" in message and "seq_length 33 is no multiple of 2" in message
    assert "\n" not in message


def test_context_parallelism_counts_its_ranks_and_refuses_what_it_cannot_split(tmp_path):
    args = run_args(tmp_path, context_parallel_size=2, model_parallel_size=2, num_gpus=8)
    assert args.data_parallel_size == 2
    assert NeoXArgs.from_dict({**TINY_RUN, "context_parallel_size": 2, "num_gpus": 2, "padded_vocab_size": 128}
                              ).architecture().context_parallel_size == 2
    assert args.train_batch_size == 2 * args.train_micro_batch_size_per_gpu  # the context ranks read the same samples
    refusals = [(dict(num_gpus=3), "context_parallel_size: 2 x model_parallel_size 1 x pipeline stages 1 does not "
                 "divide the 3 ranks"),
                (dict(num_gpus=2, seq_length=30), "context_parallel_size: 2 cuts each sequence into 4 equal chunks, "
                 "but seq_length 30 is no multiple of 4"),
                (dict(num_gpus=4, pipe_parallel_size=2), "pipe_parallel_size: context_parallel_size 2 is not built with "
                 "pipeline stages"),
                (dict(num_gpus=2, train_impl="reinforce", reward_function="rewards.py:score", temperature=1.0,
                      pack_impl="unpacked", train_data_paths=["d"], train_label_data_paths=["l"]),
                 "train_impl: context_parallel_size 2 is not built with train_impl reinforce"),
                (dict(num_gpus=4, model_parallel_size=2, sequence_parallel=True), "sequence_parallel: "
                 "context_parallel_size 2 is not built with sequence parallelism"),
                (dict(num_gpus=2, context_parallel_size=0), "context_parallel_size: must be at least 1, got 0")]
    for settings, expected in refusals:
        message = config_error(tmp_path, **{"context_parallel_size": 2, **settings})
        assert f"run.yml: {expected}" in message and "\n" not in message, message


def test_a_checkpoint_saved_with_sequence_parallelism_loads_and_one_with_a_row_output_layer_is_refused():
    saved = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "model_parallel_size": 2}
    # sequence parallelism changed how the saving run ran, not its weights
    assert NeoXArgs.from_saved({**saved, "sequence_parallel": True}, "ckpt").model_parallel_size == 2
    with pytest.raises(ConfigError, match="ckpt: output_layer_parallelism: 'row': .* weights are laid out for it"):
        NeoXArgs.from_saved({**saved, "output_layer_parallelism": "row"}, "ckpt")


def test_gpt_neox_aliases(tmp_path):
    args = run_args(tmp_path, gas=3, clip_grad=0.5, precision="bfloat16")
    assert args.gradient_accumulation_steps == 3 and args.train_batch_size == 2 * 3
    assert args.gradient_clipping == 0.5
    assert args.precision == "bf16" and args.bf16 == {"enabled": True}


# --- derived values -------------------------------------------------------------------------

def test_precision_from_sections_and_from_the_precision_key(tmp_path):
    assert run_args(tmp_path).precision == "fp32"
    fp16 = run_args(tmp_path, fp16={"fp16": True, "enabled": True, "loss_scale": 0})
    assert fp16.precision == "fp16" and fp16.fp16 == {"enabled": True, "loss_scale": 0} and fp16.bf16 is None
    assert run_args(tmp_path, fp16={"enabled": False}).precision == "fp32"
    by_key = run_args(tmp_path, precision="fp16")
    assert by_key.fp16 == {"enabled": True}


@pytest.mark.parametrize(
    ("batch", "expected"),  # (micro, grad accumulation, total) with one data-parallel rank
    [
        ({"train_micro_batch_size_per_gpu": 4}, (4, 1, 4)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, (4, 3, 12)),
        ({"train_micro_batch_size_per_gpu": 4, "train_batch_size": 16}, (4, 4, 16)),
        ({"train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": 2, "train_batch_size": 16}, (8, 2, 16)),
        ({"train_micro_batch_size_per_gpu": None, "train_batch_size": 6}, (6, 1, 6)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 8}, (2, 4, 8)),
    ],
)
def test_batch_arithmetic(tmp_path, batch, expected):
    args = run_args(tmp_path, **batch)
    got = (args.train_micro_batch_size_per_gpu, args.gradient_accumulation_steps, args.train_batch_size)
    assert got == expected


def test_batch_arithmetic_uses_data_parallel_ranks(tmp_path):
    args = run_args(tmp_path, num_gpus=4, train_batch_size=32)
    assert args.global_num_gpus == 4 and args.data_parallel_size == 4
    assert args.gradient_accumulation_steps == 32 // (2 * 4)


def test_schedule_defaults(tmp_path):
    args = run_args(tmp_path, warmup=0.05)
    assert args.lr_decay_iters == 100 and args.warmup_iters == 5
    args = run_args(tmp_path, warmup=0.1, lr_decay_iters=80)
    assert args.lr_decay_iters == 80 and args.warmup_iters == 8
    assert args.lr == 0.001 and args.zero_stage == 0
    assert args.max_position_embeddings == 32
    # GPT-NeoX keeps the product unrounded: 1% of 150 iterations is 1.5 iterations of warmup
    assert run_args(tmp_path, train_iters=150).warmup_iters == 0.01 * 150
    # lr_decay_fraction gives lr_decay_iters when that is unset: floor(100 x 0.55)
    assert run_args(tmp_path, lr_decay_fraction=0.55).lr_decay_iters == 55
    assert run_args(tmp_path, lr_decay_fraction=0.55, lr_decay_iters=70).lr_decay_iters == 70


def test_no_learning_rate_anywhere_trains_at_gpt_neox_adam_default(tmp_path):
    assert run_args(tmp_path, optimizer={"type": "Adam", "params": {}}).lr == 0.001
    assert run_args(tmp_path, optimizer=None).optimizer["params"]["lr"] == 0.001


def test_checkpoint_factor_and_save_interval_are_one_setting(tmp_path):
    assert run_args(tmp_path, save_interval=25).checkpoint_factor == 25
    assert run_args(tmp_path, checkpoint_factor=30).save_interval == 30


def test_mlp_width_follows_known_models(tmp_path):
    """Published per-projection widths (Hugging Face configs) from the settings GPT-NeoX's configs give them."""
    def built(**settings):
        args = run_args(tmp_path, **settings).with_values({"padded_vocab_size": 256}, "test")
        return args.architecture().intermediate_size

    assert built(hidden_size=768, num_attention_heads=12) == 3072  # Pythia-160M: 4 x hidden
    assert built(hidden_size=4096, num_attention_heads=32, activation="swiglu", intermediate_size=32768,
                 mlp_multiple_of=256) == 11008  # Llama-7B
    assert built(hidden_size=2048, num_attention_heads=32, num_kv_heads=4, activation="swiglu",
                 intermediate_size=16384, mlp_multiple_of=256) == 5632  # TinyLlama-1.1B
    message = config_error(tmp_path, activation="swiglu", intermediate_size=98)  # int(65.3): linear1 66, linear2 32
    assert "run.yml: intermediate_size: intermediate_size=98 with mlp_multiple_of=1" in message


def test_bias_gelu_fusion_and_onnx_safe_select_gpt_neox_gelus(tmp_path):
    def approximation(**settings):
        args = run_args(tmp_path, **settings).with_values({"padded_vocab_size": 256}, "test")
        return args.architecture().gelu_approximation

    assert approximation() == "none"
    assert approximation(bias_gelu_fusion=True) == "tanh"
    assert approximation(onnx_safe=True) == "onnx_erf"
    assert approximation(bias_gelu_fusion=True, activation="relu") == "none"  # GPT-NeoX: gelu only
    assert "bias_gelu_fusion and onnx_safe" in config_error(tmp_path, bias_gelu_fusion=True, onnx_safe=True)


@pytest.mark.parametrize(("vocab", "divisible_by", "mp"), [(50277, 128, 1), (32000, 128, 1), (50277, 128, 2), (5, 1, 1)])
def test_padded_vocab_size(vocab, divisible_by, mp):
    padded = padded_vocab_size(vocab, divisible_by, mp)
    assert padded >= vocab and padded % (divisible_by * mp) == 0
    assert padded - vocab < divisible_by * mp
    assert padded_vocab_size(50277, 128, 1) == 50304  # Pythia's published vocab_size
    assert padded_vocab_size(32000, 128, 1) == 32000  # Llama's


# --- handing the settings to ranks ----------------------------------------------------------

def test_ranks_get_exactly_the_validated_settings(tmp_path):
    args = run_args(tmp_path, bias_gelu_fusion=True)
    argv = ["--local_rank=1", *handover_argv(args), "--something-else"]
    on_rank = load_args_on_rank(argv)
    assert on_rank.to_dict() == args.to_dict()
    assert on_rank.sources == args.sources and on_rank.notices == args.notices
    assert on_rank.deepspeed_config() == args.deepspeed_config()
    flag, payload = handover_argv(args)[0].split("=", 1)
    assert load_args_on_rank([flag, payload]).to_dict() == args.to_dict()


def test_rank_without_handover_says_to_use_deepy():
    with pytest.raises(ConfigError, match="start this script through deepy.py"):
        load_args_on_rank(["--local_rank=0"])


# --- numbers, whatever PyYAML made of them --------------------------------------------------

MODEL_YAML = """num_layers: 2
hidden_size: 64
num_attention_heads: 4
seq_length: 32
train_micro_batch_size_per_gpu: 2
embedded_corpus: true
"""


def yaml_args(tmp_path, text: str) -> NeoXArgs:
    return NeoXArgs.from_yaml_files([write_yaml(tmp_path, "run.yml", MODEL_YAML + text)])


def test_numbers_pyyaml_reads_as_strings_are_numbers_in_every_section(tmp_path):
    """PyYAML (YAML 1.1) reads 1e-4, 5e8 and 1.0e8 as strings; each is the number YAML 1.2 and Python read."""
    as_strings = yaml_args(tmp_path, """train_iters: 1e2
weight_decay: 1e-2
optimizer: {type: AdamW, params: {lr: 1e-4, betas: [9e-1, 0.95], eps: 1e-8, weight_decay: 0.01}}
zero_optimization: {stage: 2, reduce_bucket_size: 5e8, allgather_bucket_size: 500000000,
                    offload_optimizer: {device: cpu, ratio: 1e0}}
bf16: {enabled: true}
""")
    assert yaml.safe_load("eps: 1e-8")["eps"] == "1e-8"  # what PyYAML makes of it
    as_floats = yaml_args(tmp_path, """train_iters: 100
weight_decay: 0.01
optimizer: {type: AdamW, params: {lr: 1.0e-4, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.01}}
zero_optimization: {stage: 2, reduce_bucket_size: 500000000, allgather_bucket_size: 500000000,
                    offload_optimizer: {device: cpu, ratio: 1.0}}
bf16: {enabled: true}
""")
    config = as_strings.deepspeed_config()
    assert config == as_floats.deepspeed_config()
    assert config["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    assert type(config["zero_optimization"]["reduce_bucket_size"]) is int and as_strings.train_iters == 100
    assert as_strings.lr == 1e-4 and as_strings.weight_decay == 0.01
    extra = yaml_args(tmp_path, "train_iters: 10\ndeepspeed_extra_args: {zero_optimization: {sub_group_size: 1e9}}\n")
    assert extra.deepspeed_config()["zero_optimization"]["sub_group_size"] == 10**9


def test_fp16_loss_scaling_numbers_are_read_as_deepspeed_types(tmp_path):
    args = yaml_args(tmp_path, """train_iters: 10
fp16: {enabled: true, loss_scale: 0, initial_scale_power: 1.2e1, loss_scale_window: 1e3, hysteresis: 2,
       min_loss_scale: 1e0}
""")
    assert args.fp16 == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 1000,
                         "hysteresis": 2, "min_loss_scale": 1}
    assert all(type(args.fp16[key]) is int for key in ("initial_scale_power", "loss_scale_window", "min_loss_scale"))


def test_the_same_setting_given_twice_is_compared_as_numbers(tmp_path):
    args = yaml_args(tmp_path, "train_iters: 10\nweight_decay: 1e-2\nlr: 1e-4\n"
                               "optimizer: {type: Adam, params: {lr: 0.0001, weight_decay: 0.01}}\n")
    assert (args.lr, args.weight_decay) == (1e-4, 0.01)
    with pytest.raises(ConfigError, match=r"run.yml: weight_decay \(0.01\) and \S*run.yml: optimizer.params."
                                          r"weight_decay \(0.02\) disagree"):
        yaml_args(tmp_path, "train_iters: 10\nweight_decay: 1e-2\noptimizer: {type: Adam, params: {weight_decay: 2e-2}}\n")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("optimizer: {type: Adam, params: {lr: 1e-4, eps: abc}}", "optimizer.params.eps: 'abc' is not a number"),
        ("optimizer: {type: Adam, params: {lr: 1e-4, eps: 0}}", "optimizer.params.eps: must be positive, got 0"),
        ("optimizer: {type: Adam, params: {lr: 1e-4, eps: 1e999}}",
         "optimizer.params.eps: inf is not a finite number"),
        ("optimizer: {type: Adam, params: {lr: 1e-4, betas: [1.5, 0.95]}}",
         r"optimizer.params.betas: must each be in \[0, 1\), got \[1.5, 0.95\]"),
        ("optimizer: {type: Adam, params: {lr: 1e-4, betas: [0.9, -1e-3]}}", r"optimizer.params.betas: must each be in"),
        ("optimizer: {type: Adam, params: {lr: 1e-4, betas: 0.9}}",
         "optimizer.params.betas: expected a list of 2 numbers, got 0.9"),
        ("optimizer: {type: Adam, params: {lr: 1e-4, betas: [0.9, high]}}",
         r"optimizer.params.betas\[1\]: 'high' is not a number"),
        ("optimizer: {type: Adam, params: {lr: 1e-4, weight_decay: -1e-2}}",
         "optimizer.params.weight_decay: must not be negative, got -0.01"),
        ("optimizer: {type: SGD, params: {lr: 1e-4, momentum: 1}}", r"optimizer.params.momentum: must be in \[0, 1\)"),
        ("optimizer: {type: Adam, params: {lr: true}}", "optimizer.params.lr: True is not a number"),
        ("optimizer: {type: Adam, params: {lr: -1e-4}}", "lr: must be positive, got -0.0001"),
        ("zero_optimization: {stage: 2, reduce_bucket_size: 5.5e0}",
         "zero_optimization.reduce_bucket_size: '5.5e0' is not a whole number"),
        ("zero_optimization: {stage: 2, reduce_bucket_size: -5e8}",
         "zero_optimization.reduce_bucket_size: DeepSpeed rejects -500000000: Input should be greater than 0"),
        ("zero_optimization: {stage: 2, offload_optimizer: {device: cpu, ratio: 2e0}}",
         "zero_optimization.offload_optimizer.ratio: DeepSpeed rejects 2.0: Input should be less than or equal to 1"),
        ("zero_optimization: {stage: 3, offload_param: {device: cpu, buffer_count: many}}",
         "zero_optimization.offload_param.buffer_count: 'many' is not a whole number"),
        ("zero_optimization: {stage: 2.5}", "zero_optimization.stage: 2.5 is not a whole number"),
        ("fp16: {enabled: true, loss_scale: -1}", "fp16.loss_scale: DeepSpeed rejects -1: .*must be >= 0"),
        ("fp16: {enabled: true, initial_scale_power: 1.5e1, hysteresis: 2e-1}", "fp16.hysteresis: '2e-1' is not a whole"),
        ("bf16: {enabled: true, imediate_grad_update: true}",
         "bf16.imediate_grad_update: not a key of DeepSpeed's bf16 section"),
        ("deepspeed_extra_args: {zero_optimization: {sub_group_size: lots}}",
         "deepspeed_extra_args.zero_optimization.sub_group_size: 'lots' is not a whole number"),
        ("seed: 1.5e-3", r"seed: expected int, got 0.0015 \(float\)"),
        ("seed: 12e-1", "seed: expected int, got '12e-1'"),
    ],
)
def test_a_bad_number_in_any_section_names_the_file_and_the_key_path(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=r"^\S*run\.yml: " + expected):
        yaml_args(tmp_path, "train_iters: 10\n" + text + "\n")


def test_the_number_rule_on_its_own():
    from megatron.neox_arguments.numbers import as_number

    assert as_number("1e-4", float) == 1e-4 and as_number(" 5e8 ", int) == 500_000_000
    assert as_number("9223372036854775807", int) == 2**63 - 1  # exact, not through a float
    assert as_number(5e8, int) == 500_000_000 and type(as_number(5e8, int)) is int
    assert [as_number(value, int) for value in ("5.5", 5.5, True, "0x10", "1_000", None)] == [None] * 6


def test_reinforce_without_a_reward_is_refused_in_one_line_saying_what_it_needs(tmp_path):
    message = config_error(tmp_path, train_impl="reinforce")
    assert "\n" not in message and "reward_function" in message and "dataset_impl: online" in message


def test_reinforce_settings_keep_gpt_neox_defaults_and_refuse_what_cannot_run(tmp_path):
    args = run_args(tmp_path, train_impl="reinforce", dataset_impl="online")
    assert (args.kl_impl, args.kl_div_beta, args.fp32_reinforce, args.reinforce_leave_one_out) == ("mse", 0.1, True,
                                                                                                   False)
    assert (args.online_dataserver_ips, args.online_dataserver_ports) == ("localhost", 10000)
    served = config_error(tmp_path, train_impl="reinforce", dataset_impl="online", serve_model_weights=True)
    assert "\n" not in served and "set serve_model_weights: false" in served
    rollouts = dict(train_impl="reinforce", reward_function="r.py:score", pack_impl="unpacked", temperature=1.0,
                    train_data_paths=["chats"], train_label_data_paths=["chats_label"])
    assert "train_label_data_paths" in config_error(tmp_path, **{**rollouts, "train_label_data_paths": None})
    assert "set temperature" in config_error(tmp_path, **{**rollouts, "temperature": 0.0})
    assert "pack_impl: unpacked" in config_error(tmp_path, **{**rollouts, "pack_impl": "packed"})
    assert "2 or more" in config_error(tmp_path, **rollouts, reinforce_advantage="group_normalized",
                                       reinforce_num_completions=1)
    assert "contradicts" in config_error(tmp_path, **rollouts, reinforce_leave_one_out=True,
                                         reinforce_advantage="group_normalized")
    assert "file.py:name" in config_error(tmp_path, **{**rollouts, "reward_function": "r.py"})
    assert "set train_impl: reinforce" in config_error(tmp_path, dataset_impl="online")
    assert "kl_impl" in config_error(tmp_path, **rollouts, kl_impl="k3")
    assert "must not be negative" in config_error(tmp_path, **rollouts, rollout_samples_shown=-1)
    assert "set it to 0" in config_error(tmp_path, train_impl="reinforce", dataset_impl="online",
                                         rollout_samples_shown=2)
    assert "remove rollout_log" in config_error(tmp_path, train_impl="reinforce", dataset_impl="online",
                                                rollout_log=str(tmp_path / "rollouts.jsonl"))


@pytest.mark.parametrize("names", [("reward_function", "reward_model"), ("reward_model", "dataset_impl"),
                                   ("reward_function", "dataset_impl")])
def test_reinforce_with_more_than_one_reward_is_refused_in_one_line_naming_them(tmp_path, names):
    values = {"reward_function": "r.py:score", "reward_model": "checkpoints/rm", "dataset_impl": "online"}
    message = config_error(tmp_path, train_impl="reinforce", pack_impl="unpacked", temperature=1.0,
                           train_data_paths=["chats"], train_label_data_paths=["chats_label"],
                           **{name: values[name] for name in names})
    assert "\n" not in message and "set exactly one of reward_function, reward_model and dataset_impl: online" in message
    assert all(name in message for name in names)



@pytest.mark.parametrize(
    ("optimizer", "zero", "error"),
    [
        ({"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "foreach": False}}, None, None),
        ({"type": "Adam", "params": {"lr": 1e-3, "foreach": False}}, None, "optimizer.params.foreach: not a parameter of FusedAdam"),
        ({"type": "AdamW", "params": {"lr": 1e-3, "fp32_optimizer_states": True}},
         {"stage": 2, "offload_optimizer": {"device": "cpu"}}, None),
        ({"type": "AdamW", "params": {"lr": 1e-3, "set_grad_none": True}},
         {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "optimizer.params.set_grad_none: not a parameter of DeepSpeedCPUAdam"),
        ({"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9, "nesterov": True}}, None, None),
        ({"type": "SGD", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}, None, "optimizer.params.betas: not a parameter of SGD"),
        ({"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}, None, "DeepSpeed clips with gradient_clipping"),
    ],
    ids=["torch-adam-foreach", "fused-adam-foreach", "cpu-adam", "cpu-adam-set-grad-none", "sgd", "sgd-betas",
         "max-grad-norm"],
)
def test_optimizer_params_are_those_of_the_optimizer_deepspeed_builds(tmp_path, single_rank_world, optimizer, zero,
                                                                       error):
    """What the check accepts DeepSpeed's engine builds; what it refuses DeepSpeed's engine fails on at start."""
    import deepspeed
    import torch

    overrides = {"optimizer": optimizer, **({"zero_optimization": zero} if zero else {})}
    if error is None:
        config = run_args(tmp_path, **overrides).deepspeed_config()
    else:
        message = config_error(tmp_path, **overrides)
        assert message.startswith(f"{tmp_path / 'run.yml'}: ") and error in message, message
        config = {**run_args(tmp_path).deepspeed_config(), "optimizer": optimizer}
        if zero:
            config["zero_optimization"] = zero
    model = torch.nn.Linear(4, 4)
    if error is None:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        with pytest.raises((TypeError, ValueError)):
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
