"""Shared by the engine-checkpoint tests and their 2-rank worker: a small model, engines, oracles.

The oracles read engine state through DeepSpeed's own APIs (GatheredParameters, the tensor-fragment
API, the optimizers' attributes), not through the code under test.
"""

from __future__ import annotations

import copy

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param

from megatron.learning_rates import set_learning_rate

VOCAB = 37
HIDDEN = 24
SEQ = 6
MICRO_BATCH = 2

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class MiniTransformer(torch.nn.Module):
    """Embedding, two pre-norm MLP blocks with odd-sized layers, tied-free LM head; ~5k parameters."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "norm": torch.nn.LayerNorm(HIDDEN),
                    "up": torch.nn.Linear(HIDDEN, 29),
                    "down": torch.nn.Linear(29, HIDDEN),
                }
            )
            for _ in range(2)
        )
        self.final_norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.register_buffer("logit_scale", torch.tensor([0.5]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = hidden + block["down"](torch.nn.functional.gelu(block["up"](block["norm"](hidden))))
        logits = self.head(self.final_norm(hidden)) * self.logit_scale.to(hidden.dtype)
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
        )


def ds_config(precision: str, stage: int, **extra) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, **extra.pop("optimizer_params", {})}},
        "zero_optimization": {"stage": stage, **extra.pop("zero", {})},
        "steps_per_print": 10**9,
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    config.update(extra)
    return config


def build_engine(config: dict, seed: int, frozen: tuple[str, ...] = ()):
    torch.manual_seed(seed)
    model = MiniTransformer()
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    # A copy: some releases (0.14) pop entries such as ``torch_adam`` out of the config they are given.
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=copy.deepcopy(config)
    )
    return engine


def batch(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)


def train_step(engine, tokens: torch.Tensor) -> None:
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()


def eval_loss(engine, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return engine(tokens).detach().clone()


def set_lr(engine, lr: float) -> None:
    set_learning_rate(engine.optimizer, lr)


def training_weights(engine) -> dict[str, torch.Tensor]:
    """Full parameters in the training dtype, gathered under ZeRO-3."""
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: param.data.detach().cpu().clone() for name, param in params.items()}


def master_weights(engine) -> dict[str, torch.Tensor]:
    """Full fp32 master weights per parameter, read through DeepSpeed's own structures."""
    optimizer = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    if hasattr(optimizer, "fp32_groups_flat") and not hasattr(optimizer, "bit16_groups"):
        masters = {}
        for params, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat, strict=True):
            pieces = torch._utils._unflatten_dense_tensors(flat, params)
            masters.update(
                {names[id(p)]: piece.detach().cpu().clone() for p, piece in zip(params, pieces, strict=True)}
            )
        return masters
    if (
        hasattr(optimizer, "fp32_groups")
        and hasattr(optimizer, "fp16_groups")
        and not hasattr(optimizer, "grad_position")
    ):
        return {
            names[id(p)]: m.detach().cpu().clone()
            for params, group in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True)
            for p, m in zip(params, group, strict=True)
        }
    if engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled() and not engine.fp16_enabled():
        return {name: p.detach().cpu().clone() for name, p in engine.module.named_parameters()}
    return {
        name: safe_get_full_fp32_param(p).detach().cpu().clone()
        for name, p in engine.module.named_parameters()
    }


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
