"""What the peer benches share: one Hugging Face folder both sides start from, our engine built from it the way a
run builds it (the folder's settings resolved as deepy.py resolves them, its weights through the load plan), the
peer's transformers model of the same folder in a DeepSpeed engine of the same config, and the timed steps.

Both sides take the same batch, the same DeepSpeed config and the same loss (mean next-token cross entropy in
fp32 over the same positions), so the first losses agree up to the precision's rounding: each record carries its
first loss, and a bench prints both, which shows the two sides computed the same thing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from statistics import median

import yaml


def save_folder(config, directory: Path, seed: int = 1234) -> Path:
    """A Hugging Face folder of a model of ``config`` (a transformers config) drawn from ``seed``, fp32 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def batch(options: argparse.Namespace, vocab: int):
    """The one batch every step of either side trains on: micro batch x (seq + 1) tokens, the last as labels."""
    import torch

    return torch.randint(0, vocab, (options.micro_batch, options.seq + 1), generator=torch.Generator().manual_seed(0))


def deepspeed_config(options: argparse.Namespace) -> dict:
    import bench_world as world

    return world.deepspeed_config(options.micro_batch, options.zero_stage, options.precision)


def our_engine(folder: Path, options: argparse.Namespace, scratch: Path, **settings):
    """Our engine of a fine-tune of ``folder`` with ``settings`` (LoRA, for instance): settings resolved from a
    config file as deepy.py resolves them (the vocabulary is the folder's, as its tokenizer would pad it), the
    model built, the folder's weights loaded through the load plan."""
    import bench_world as world

    from megatron.checkpointing import load_checkpoint, plan_load
    from megatron.hf import HF_FOLDER
    from megatron.launch.run_context import settings_for_run
    from megatron.model import build_model
    from megatron.optim.optimizers import build_param_groups

    config = scratch / "run.yml"
    config.write_text(yaml.safe_dump({
        "load": str(folder), "finetune": True, "train_iters": 10, "seq_length": options.seq,
        "train_micro_batch_size_per_gpu": options.micro_batch, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "embedded_corpus": True, **settings}))
    args = settings_for_run([str(config)]).with_values({"padded_vocab_size": options.vocab}, "bench")
    model = build_model(args.architecture(), args.seed, lora=args.lora())
    engine = world.build_engine(model, deepspeed_config(options), model_parameters=build_param_groups(model, 0.0))
    load_checkpoint(engine, plan_load(args, 1, hf_source=HF_FOLDER))
    return engine


def their_engine(model, options: argparse.Namespace):
    """The peer's ``model`` (transformers, with PEFT's adapters or without) in a DeepSpeed engine of the same
    config, training the parameters that require a gradient, as PEFT's and transformers' guides set it up."""
    import bench_world as world

    return world.build_engine(model, deepspeed_config(options),
                              model_parameters=[p for p in model.parameters() if p.requires_grad], mpu=False)


def our_loss(engine, tokens):
    from megatron.model import causal_lm_loss

    return causal_lm_loss(engine(tokens[:, :-1], parallel_output=True), tokens[:, 1:], vocab_parallel=True)


def their_loss(engine, tokens):
    import torch

    logits = engine(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def timed_steps(engine, loss_of, tokens, steps: int) -> tuple[float, float]:
    """(the first step's loss, the median of ``steps`` timed optimizer steps after it): forward, loss, backward,
    step on ``tokens``; the first step warms kernels and optimizer state up."""
    def step() -> float:
        loss = loss_of(engine, tokens)
        engine.backward(loss)
        engine.step()
        return loss.item()

    first_loss = step()
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return first_loss, median(seconds)
