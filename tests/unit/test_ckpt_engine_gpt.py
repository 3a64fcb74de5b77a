"""The module-only engine path with the project's own GPT model (GPT-NeoX layout, untied and tied head)."""

from __future__ import annotations

import deepspeed
import pytest
import torch

from megatron.checkpointing.loading.module_load import load_module_only
from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.checkpointing.saving.engine_save import save_engine_checkpoint
from megatron.model import build_model, causal_lm_loss
from megatron.neox_arguments import NeoXArgs
from tests.ckpt_engines import bits_equal, ds_config, master_weights, set_lr, training_weights

pytestmark = pytest.mark.usefixtures("single_rank_world")

VOCAB = 96


def _gpt_engine(stage: int, seed: int, tied: bool):
    args = NeoXArgs.from_dict(
        dict(
            num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=VOCAB,
            hidden_dropout=0.0, attention_dropout=0.0, pos_emb="rotary", rotary_pct=0.25,
            gpt_j_residual=True, no_weight_tying=not tied, norm="layernorm", activation="gelu", seed=seed,
        )
    )  # fmt: skip
    model = build_model(args.architecture(), seed)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config("bf16", stage)
    )
    return engine


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def _loss(engine, tokens: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])


def _step(engine, tokens: torch.Tensor) -> None:
    engine.backward(_loss(engine, tokens))
    engine.step()


@pytest.mark.parametrize(
    "stage,tied", [(1, False), (3, False), (3, True)], ids=["zero1", "zero3", "zero3-tied"]
)
def test_gpt_module_only_load(tmp_path, stage, tied):
    engine_a = _gpt_engine(stage, seed=1, tied=tied)
    _step(engine_a, _tokens(0))
    assert save_engine_checkpoint(engine_a, tmp_path, "global_step1", {"iteration": 1}) is None
    tag_dir = tmp_path / "global_step1"
    saved = (
        master_weights(engine_a)
        if stage == 3
        else {n: w.float() for n, w in training_weights(engine_a).items()}
    )
    with torch.no_grad():
        loss_a = _loss(engine_a, _tokens(5))
    for optimizer_file in tag_dir.glob("*optim_states.pt"):
        optimizer_file.unlink()

    engine_b = _gpt_engine(stage, seed=2, tied=tied)
    weights = read_module_weights(tag_dir)
    assert set(weights) == set(engine_a.module.state_dict())
    assert any(name.startswith("sequential.2.") for name in weights)
    load_module_only(engine_b, weights)
    set_lr(engine_b, 0.0)
    _step(engine_b, _tokens(0))

    trained, masters = training_weights(engine_b), master_weights(engine_b)
    for name, value in saved.items():
        assert bits_equal(trained[name], value.bfloat16()), name
        assert bits_equal(masters[name], value), name
    with torch.no_grad():
        assert torch.equal(_loss(engine_b, _tokens(5)), loss_a)
