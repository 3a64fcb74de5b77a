"""The bases fine-tuned today, against transformers itself: Llama 3.1+ RoPE scaling (llama3, and linear and
yarn), Mistral's sliding window, Qwen2's q/k/v biases, Qwen3's per-head q/k norms and wider heads.

Each tiny model is built with transformers' own classes and saved by save_pretrained (the kinds of
tests/e2e/test_hf_conversion.py). Our model read from that folder gives transformers' logits at every position
of a sequence longer than the scaling's original length (8) and the window (6), and one step of a real
DeepSpeed engine started from the folder gives transformers' own gradient. Each variant switched off
(the scaling ignored, as GPT-NeoX ignores it) changes the logits far above that tolerance.
"""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing import load_checkpoint, plan_load
from megatron.hf import HF_FOLDER, load_hf_module_weights
from megatron.hf.config import spec_from_hf_config
from megatron.hf.mapping import convert_tensors, hf_to_ours
from megatron.launch.run_context import resolve_run_settings, settings_for_run
from megatron.model import build_model
from tests.e2e.test_hf_conversion import VOCAB, logits_of, make_hf_model, our_args, save_hf
from tests.unit.test_hf_engine import build_engine, engine_args, engine_loss

pytestmark = pytest.mark.usefixtures("single_rank_world")

LENGTH = 40  # past the original length of every scaling (8) and Mistral's window (6)
# kind -> each variant switched off, as the settings that switch it off
SWITCHED_OFF = {
    "llama31": [dict(rope_scaling=None)],
    "llama_yarn": [dict(rope_scaling=None)],
    "llama_linear": [dict(rope_scaling=None)],
    "neox_yarn": [dict(rope_scaling=None)],
    "mistral": [dict(sliding_window_width=None)],
    "qwen2": [dict(rope_scaling=None), dict(add_qkv_bias=False)],
    "qwen3": [dict(qk_layernorm=False)],
}


def long_tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(SWITCHED_OFF))
def test_logits_equal_transformers_at_every_position_and_not_with_the_variant_off(kind, tmp_path):
    model = make_hf_model(kind)
    hf_dir = save_hf(model, tmp_path / "hf")
    args = our_args(hf_dir)
    weights = load_hf_module_weights(hf_dir, args.architecture())
    ours = build_model(args.architecture(), args.seed).eval()
    ours.load_state_dict(weights, strict=True)
    batch = long_tokens()
    with torch.no_grad():
        expected = model(batch).logits
        actual = logits_of(ours, batch)
    assert expected.abs().max() > 1
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)

    for off in SWITCHED_OFF[kind]:
        plain = build_model(our_args(hf_dir, **off).architecture(), args.seed).eval()
        kept = {name: tensor for name, tensor in weights.items() if name in plain.state_dict()}
        plain.load_state_dict(kept, strict=True)  # every weight the plain model has, from the folder
        with torch.no_grad():
            difference = (logits_of(plain, batch) - expected).abs().amax(dim=(0, 2))
        assert difference.max() > 1e-2, f"{kind} with {off}: the variant changes nothing"


def engine_from_folder(model, tmp_path):
    """(settings, a fp32 ZeRO-0 engine) of a fine-tune loaded from `model` saved as a Hugging Face folder."""
    hf_dir = save_hf(model, tmp_path / "hf")
    args = engine_args(model, load=str(hf_dir), finetune=True, zero_optimization={"stage": 0})
    plan = plan_load(args, data_parallel_size=1, hf_source=HF_FOLDER)
    engine = build_engine(args)
    load_checkpoint(engine, plan)
    return args, engine


@pytest.mark.parametrize("kind", list(SWITCHED_OFF))
def test_one_step_from_the_folder_has_the_gradient_of_transformers(kind, tmp_path):
    model = make_hf_model(kind)
    args, engine = engine_from_folder(model, tmp_path)
    batch = long_tokens(seed=1)
    loss = engine_loss(engine, batch)
    engine.backward(loss)
    model.train()
    expected_loss = model(input_ids=batch, labels=batch).loss
    expected_loss.backward()
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    spec = spec_from_hf_config(model.config.to_dict())
    hf_grads = {name: p.grad for name, p in model.named_parameters()}  # a tied output layer: the embedding's, once
    expected = convert_tensors(hf_grads.items(), hf_to_ours(spec.family, spec.architecture()), "grads")
    ours = {name: p.grad.cpu() for name, p in engine.module.named_parameters()}
    assert sorted(ours) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_fine_tune_file_without_model_settings_takes_the_variants_from_the_folder(tmp_path):
    """What deepy.py resolves before any rank starts for `load:` at a Qwen2.5 folder and no model setting."""
    model = make_hf_model("qwen2")
    hf_dir = save_hf(model, tmp_path / "hf", tokenizer=True)
    finetune = tmp_path / "finetune.yml"
    finetune.write_text(f"load: {hf_dir}\nfinetune: true\ntrain_iters: 2\nseq_length: 48\n"
                        "train_micro_batch_size_per_gpu: 1\ndata_path: corpus/text_document\n")
    args = resolve_run_settings(settings_for_run([str(finetune)]))
    assert args.architecture().compared_fields() == spec_from_hf_config(model.config.to_dict()).architecture().compared_fields()
    assert (args.hf_model_type, args.add_qkv_bias, args.rope_scaling["rope_type"]) == ("qwen2", True, "yarn")
    assert args.source_of("rope_scaling") == str(hf_dir / "config.json")
