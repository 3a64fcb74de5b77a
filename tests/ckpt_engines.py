"""Real DeepSpeed engines and real checkpoints of small networks, shared by the checkpoint tests and
their 2-rank worker; the oracles that read engine state.

Two models: `MiniTransformer` (embedding, norms, odd-sized layers, a buffer) for the weight-level
engine tests, `TinyNet` (dropout, so the RNG state changes what a step computes) for the save/load
orchestration tests. Both return their loss, so one `train_step` drives either. The oracles read
engine state through DeepSpeed's own APIs (GatheredParameters, the tensor-fragment API, the
optimizers' attributes), not through the code under test.
"""

from __future__ import annotations

import copy
from pathlib import Path

import deepspeed
import torch
import torch.nn as nn
from deepspeed.utils import safe_get_full_fp32_param

from megatron.neox_arguments.arguments import NeoXArgs
from megatron.training.learning_rates import set_learning_rate

VOCAB = 37
HIDDEN = 24
SEQ = 6
MICRO_BATCH = 2

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

ARCHITECTURE = dict(num_layers=2, hidden_size=8, num_attention_heads=2, padded_vocab_size=16, seq_length=4,
                    norm="layernorm", activation="gelu", pos_emb="rotary")


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


class TinyNet(nn.Module):
    """Two linear layers with dropout in between, so RNG state changes what a step computes."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.inp(x)))).float().pow(2).mean()


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


def make_args(stage: int = 1, precision: str = "fp32", **overrides) -> NeoXArgs:
    """Validated settings whose optimizer, batch, precision and ZeRO stage are those of ds_config()."""
    values = dict(ARCHITECTURE, zero_optimization={"stage": stage}, precision=precision,
                  train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_accumulation_steps=1,
                  train_batch_size=MICRO_BATCH, optimizer={"type": "Adam", "params": {"lr": 1e-2}})
    if precision in ("bf16", "fp16"):
        values[precision] = {"enabled": True}
    values.update(overrides)
    return NeoXArgs.from_dict(values)


def build_engine(config: dict | NeoXArgs, seed: int = 0, frozen: tuple[str, ...] = ()):
    """A MiniTransformer engine for a DeepSpeed config; a TinyNet engine for settings (make_args)."""
    if isinstance(config, NeoXArgs):
        model_class, config = TinyNet, ds_config(config.precision, config.zero_stage)
    else:
        model_class = MiniTransformer
    torch.manual_seed(seed)
    model = model_class()
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    # A copy: some releases (0.14) pop entries such as ``torch_adam`` out of the config they are given.
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=copy.deepcopy(config)
    )
    return engine


def batch(seed: int) -> torch.Tensor:
    """Token ids for a MiniTransformer."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)


def tiny_batch(args: NeoXArgs, step: int) -> torch.Tensor:
    """Inputs for a TinyNet, in the training dtype, on the accelerator."""
    from deepspeed.accelerator import get_accelerator

    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(MICRO_BATCH, 8, generator=generator).to(DTYPES[args.precision])
    return inputs.to(get_accelerator().current_device_name())


def train_step(engine, inputs: torch.Tensor) -> float:
    loss = engine(inputs)
    engine.backward(loss)
    engine.step()
    return loss.item()


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


def refresh_that_only_checks(engine, values, write_trained) -> None:
    """A stand-in for master_weights.refresh_master_weights that writes the parameters but no master, then runs
    the refresh's own check: what a load would do if the refresh missed this optimizer's master."""
    from megatron.checkpointing.loading.master_weights import verify_master_weights

    for name in values:
        write_trained(name)
    verify_master_weights(engine)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def stored_client_state(tag_dir: Path) -> dict:
    """Every entry of the model-states file a tag's client state is read from (the inventory's choice), but the
    module weights."""
    from megatron.checkpointing.ondisk.inventory import inventory_tag
    from megatron.checkpointing.ondisk.module_weights import load_checkpoint_file

    tag = inventory_tag(Path(tag_dir).parent, Path(tag_dir).name)
    return {key: value for key, value in load_checkpoint_file(tag.metadata_file).items() if key != "module"}


def saved_checkpoint(root: Path, args: NeoXArgs, iterations=(1,), client_state: dict | None = None) -> Path:
    """Train a fresh engine and let DeepSpeed itself save global_step<N> after each listed iteration."""
    engine = build_engine(args)
    for step in range(1, max(iterations) + 1):
        train_step(engine, tiny_batch(args, step))
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
