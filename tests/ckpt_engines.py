"""Real DeepSpeed engines and real checkpoints of a tiny network, shared by the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from megatron.neox_arguments.arguments import NeoXArgs

PRECISION_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

ARCHITECTURE = dict(num_layers=2, hidden_size=8, num_attention_heads=2, padded_vocab_size=16, seq_length=4,
                    norm="layernorm", activation="gelu", pos_emb="rotary")


class TinyNet(nn.Module):
    """Two linear layers with dropout in between, so RNG state changes what a step computes."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.inp(x))))


def make_args(stage: int = 1, precision: str = "fp32", **overrides) -> NeoXArgs:
    values = dict(ARCHITECTURE, zero_optimization={"stage": stage}, precision=precision, zero_stage=stage,
                  train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, train_batch_size=2,
                  optimizer={"type": "Adam", "params": {"lr": 1e-2}})
    if precision in ("bf16", "fp16"):
        values[precision] = {"enabled": True}
    values.update(overrides)
    return NeoXArgs(values)


def deepspeed_config(args: NeoXArgs) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "optimizer": args.optimizer,
        "zero_optimization": args.zero_optimization,
        "steps_per_print": 10**9,
    }
    for name in ("bf16", "fp16"):
        if getattr(args, name):
            config[name] = getattr(args, name)
    return config


def build_engine(args: NeoXArgs, seed: int = 0):
    import deepspeed

    torch.manual_seed(seed)
    model = TinyNet()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=deepspeed_config(args))
    return engine


def batch(args: NeoXArgs, step: int) -> torch.Tensor:
    from deepspeed.accelerator import get_accelerator

    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(2, 8, generator=generator).to(PRECISION_DTYPE[args.precision])
    return inputs.to(get_accelerator().current_device_name())


def train_step(engine, args: NeoXArgs, step: int) -> float:
    loss = engine(batch(args, step)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def saved_checkpoint(root: Path, args: NeoXArgs, iterations=(1,), client_state: dict | None = None) -> Path:
    """Train a fresh engine and let DeepSpeed itself save global_step<N> after each listed iteration."""
    engine = build_engine(args)
    for step in range(1, max(iterations) + 1):
        train_step(engine, args, step)
        if step in iterations:
            state = {"iteration": step, "consumed_train_samples": 2 * step, "args": args.to_dict()}
            state.update(client_state or {})
            engine.save_checkpoint(str(root), tag=f"global_step{step}", client_state=state)
    return root


def tiny_hf_model(path: Path) -> Path:
    """A random-init GPTNeoXForCausalLM saved by transformers (config.json + model.safetensors)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    GPTNeoXForCausalLM(config).save_pretrained(path)
    return path


def hf_settings(hf_dir: Path) -> dict:
    """Our settings for that model, as megatron.hf derives them from its config.json."""
    from megatron.hf.config import spec_from_hf_config
    from megatron.hf.io import read_hf_config

    spec = spec_from_hf_config(read_hf_config(hf_dir))
    return dict(spec.settings, padded_vocab_size=spec.vocab_size)
