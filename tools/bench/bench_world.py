"""A gloo world of benchmark processes on this machine, with megatron-core's process groups, and the models and
DeepSpeed engines the benches build in it."""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger as deepspeed_logger
from megatron.core import parallel_state
from procmem import return_freed_memory_to_os

from megatron.launch.launcher import free_port
from megatron.model import causal_lm_loss
from megatron.runtime.initialize import ModelParallelUnit, init_deepspeed_distributed, leave_process_group

# Architecture settings of the two families the benches build (GPT-NeoX's names), on top of model_settings.
PYTHIA = {"pos_emb": "rotary", "rotary_pct": 0.25, "gpt_j_residual": True, "no_weight_tying": True}
LLAMA = {"pos_emb": "rotary", "no_weight_tying": True, "norm": "rmsnorm", "activation": "swiglu",
         "use_bias_in_norms": False, "use_bias_in_attn_linear": False, "use_bias_in_mlp": False}


def measuring_process(threads: int, return_freed_memory: bool = True) -> bool:
    """Set this process up to measure in: ``threads`` torch threads (0: torch's default), DeepSpeed's logger at
    warnings, and unless told otherwise glibc returning freed large blocks to the OS, so that RSS shows what each
    call allocates (procmem.return_freed_memory_to_os; False where it cannot)."""
    if threads:
        torch.set_num_threads(threads)
    deepspeed_logger.setLevel("WARNING")
    return return_freed_memory_to_os() if return_freed_memory else False


def init_world(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port or free_port())
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world_size),
                        ("LOCAL_SIZE", world_size)):
        os.environ[name] = str(value)
    if not dist.is_initialized():
        accelerator = get_accelerator()
        on_cpu = accelerator.device_name() == "cpu"
        init_deepspeed_distributed(dist_backend="gloo" if on_cpu else accelerator.communication_backend_name())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def leaves_the_world(rank_main: Callable) -> Callable:
    """``rank_main`` (what a bench runs on each rank), destroying the rank's process groups once it returned: a
    finished gloo rank left to the interpreter's teardown can abort (pytorch#190489), failing the bench after
    its work (leave_process_group; a rank that raised keeps them)."""

    @functools.wraps(rank_main)
    def run(*args, **kwargs):
        result = rank_main(*args, **kwargs)
        leave_process_group()
        return result

    return run


def model_settings(options: argparse.Namespace, **settings) -> dict:
    """GPT-NeoX settings of a model of the bench's ``--layers``, ``--hidden``, ``--heads``, ``--seq`` and
    ``--vocab`` (harness.bench_parser's flags), without dropout, seed 1234; ``settings`` added or overriding."""
    return {"num_layers": options.layers, "hidden_size": options.hidden, "num_attention_heads": options.heads,
            "seq_length": options.seq, "max_position_embeddings": options.seq, "padded_vocab_size": options.vocab,
            "hidden_dropout": 0.0, "attention_dropout": 0.0, "seed": 1234, **settings}


def deepspeed_config(micro_batch: int, zero_stage: int, precision: str, optimizer: str = "Adam", lr: float = 1e-4,
                     **settings) -> dict:
    """A DeepSpeed config: one micro batch per step, ``optimizer`` at ``lr``, no progress prints; ``settings``
    added or overriding."""
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": optimizer, "params": {"lr": lr}}, "zero_optimization": {"stage": zero_stage},
              "steps_per_print": 10**9, **settings}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def build_engine(model: torch.nn.Module, config: dict, model_parameters=None, mpu: bool = True):
    """A DeepSpeed engine training ``model`` (all its parameters unless ``model_parameters``); ``mpu``: with
    megatron-core's process groups (a pipeline module brings its own)."""
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=model.parameters() if model_parameters is None
                                      else model_parameters, mpu=ModelParallelUnit() if mpu else None)
    return engine


def train_step(engine, tokens: torch.Tensor, context_parallel: bool = False) -> None:
    """Forward, causal language-model loss, backward and optimizer step on ``tokens`` (one extra for the labels);
    ``context_parallel``: the model computes this context-parallel rank's share of the sequence."""
    loss = causal_lm_loss(engine(tokens[:, :-1], parallel_output=True), tokens[:, 1:], vocab_parallel=True,
                          context_parallel=context_parallel)
    engine.backward(loss)
    engine.step()
