"""GPTModel inside a real DeepSpeed engine: bf16, ZeRO-3, tied embeddings, activation checkpointing."""

from __future__ import annotations

import deepspeed
import pytest
import torch

from megatron.model import build_model, causal_lm_loss
from megatron.optim.optimizers import build_param_groups
from tests.unit.test_model import LLAMA, tiny_args, tokens

pytestmark = pytest.mark.usefixtures("single_rank_world")


def test_trains_under_zero3_bf16_with_tied_embeddings_and_activation_checkpointing():
    model = build_model(tiny_args(LLAMA, no_weight_tying=False, checkpoint_activations=True).architecture(), 1234)
    groups = build_param_groups(model, weight_decay=0.01)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    batch = tokens(seed=3).to(engine.device)
    losses = []
    for _ in range(5):
        logits = engine(batch[:, :-1])
        assert logits.dtype == torch.bfloat16
        loss = causal_lm_loss(logits, batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses


@pytest.mark.slow
def test_a_compiled_engine_computes_what_the_eager_one_does():
    """`torch_compile: true` goes through DeepSpeed's engine.compile; our autograd functions (split_qkv,
    swiglu) trace, the losses of two steps match eager, and parameter names stay GPT-NeoX's."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    batch = tokens(seed=4)
    losses, names = {}, {}
    for compiled in (False, True):
        model = build_model(tiny_args(LLAMA, num_layers=1).architecture(), 1234)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        if compiled:
            engine.compile()
        losses[compiled] = []
        for _ in range(2):
            loss = causal_lm_loss(engine(batch[:, :-1].to(engine.device)), batch[:, 1:].to(engine.device))
            engine.backward(loss)
            engine.step()
            losses[compiled].append(loss.item())
        names[compiled] = list(engine.module.state_dict())
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[False][1] != losses[False][0]  # the second step saw updated weights
    assert names[True] == names[False]
