"""HF interop with real DeepSpeed engines: ZeRO-2 checkpoints of ours -> zero_to_fp32 and HF; fine-tuning from HF."""

from __future__ import annotations

import deepspeed
import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from megatron.checkpointing import load_checkpoint, plan_load, save_checkpoint
from megatron.hf import HF_FOLDER
from megatron.hf.config import spec_from_hf_config
from megatron.hf.convert import convert_hf_to_neox, convert_neox_to_hf
from megatron.model import build_model, causal_lm_loss
from megatron.neox_arguments import NeoXArgs
from megatron.optim.optimizers import build_param_groups
from tests.e2e.test_hf_conversion import make_hf_model, save_hf, tokens

pytestmark = pytest.mark.usefixtures("single_rank_world")


def engine_args(hf_model, precision: str = "fp32", **overrides) -> NeoXArgs:
    spec = spec_from_hf_config(hf_model.config.to_dict())
    values = {**spec.settings, "train_iters": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "hidden_dropout": 0.0, "attention_dropout": 0.0, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-6}}, "gradient_clipping": 0.0, **overrides}
    if precision != "fp32":
        values[precision] = {"enabled": True}
    return NeoXArgs.from_dict({**values, "padded_vocab_size": spec.vocab_size})


def build_engine(args: NeoXArgs):
    model = build_model(args.architecture(), args.seed)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=build_param_groups(model, args.weight_decay), config=args.deepspeed_config()
    )
    return engine


def engine_loss(engine, batch: torch.Tensor) -> torch.Tensor:
    batch = batch.to(engine.device)
    return causal_lm_loss(engine(batch[:, :-1]), batch[:, 1:])


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoint_reads_with_zero_to_fp32_and_converts_to_hf(stage, tmp_path):
    from transformers import AutoModelForCausalLM

    args = engine_args(make_hf_model("llama_gqa"), save=str(tmp_path / "run"), zero_optimization={"stage": stage})
    engine = build_engine(args)
    loss = engine_loss(engine, tokens())
    engine.backward(loss)
    engine.step()
    save_checkpoint(args, engine, iteration=1, consumed_train_samples=2)
    assert any(p.name.endswith("optim_states.pt") for p in (tmp_path / "run" / "global_step1").iterdir())

    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "run"))  # DeepSpeed's own utility
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    assert sorted(fp32) == sorted(trained)
    assert all(torch.equal(fp32[k], trained[k]) for k in trained)

    convert_neox_to_hf(tmp_path / "run", tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    engine.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens()).logits, engine(tokens().to(engine.device)).cpu(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("load_from", ["converted", "hf_folder"])
def test_bf16_zero2_finetune_starts_at_the_hf_loss_and_stays_there(load_from, tmp_path):
    """Loaded weights reach the fp32 master: the step after loading keeps HF's loss (no jump to random init)."""
    hf_model = make_hf_model("neox_parallel")
    hf_dir = save_hf(hf_model, tmp_path / "hf")
    load = hf_dir
    if load_from == "converted":
        convert_hf_to_neox(hf_dir, tmp_path / "ckpt", dtype="bf16")
        load = tmp_path / "ckpt"
    args = engine_args(hf_model, "bf16", load=str(load), finetune=True)
    plan = plan_load(args, data_parallel_size=1, hf_source=HF_FOLDER)
    engine = build_engine(args)
    batch = tokens(seed=3)
    with torch.no_grad():
        hf_loss = hf_model(batch, labels=batch).loss.item()
        random_init_loss = engine_loss(engine, batch).item()
    assert abs(random_init_loss - hf_loss) > 1.0  # so the comparison below can tell the two apart

    outcome = load_checkpoint(engine, plan)
    assert outcome.iteration == 0 and not outcome.loaded_optimizer
    losses = []
    for _ in range(2):
        loss = engine_loss(engine, batch)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    assert losses[0] == pytest.approx(hf_loss, rel=2e-2)  # bf16 forward against HF's fp32
    assert losses[1] == pytest.approx(hf_loss, rel=2e-2)
