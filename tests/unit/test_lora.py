"""LoRA against PEFT itself: tiny random HF Llama and GPT-NeoX models, PEFT's adapters copied into ours.

Our fused layers (q, k, v in query_key_value; up and gate in linear1) must compute exactly what PEFT's
separate adapters on the HF modules compute: the logits, and the gradients of every A and B.
"""

from __future__ import annotations

import math
import re

import deepspeed
import pytest
import torch
from peft import LoraConfig, get_peft_model

from megatron.checkpointing.loading.master_weights import master_fragments
from megatron.contract.lora_settings import lora_settings
from megatron.data import BatchOptions
from megatron.model import build_model, causal_lm_loss
from megatron.model.lora import BaseWithoutAdapters
from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.objectives.dpo import DirectPreferenceOptimization
from megatron.optim.optimizers import build_param_groups
from tests.unit.test_model import tokens
from tests.unit.test_model_hf_equivalence import gpt_neox_pair, llama_pair
from tests.unit.test_preference_losses import hf_sequence_log_probs, pairs

pytestmark = pytest.mark.usefixtures("single_rank_world")

RANK, ALPHA = 4, 12  # alpha != rank: a scaling of 1, or alpha / sqrt(r) in place of alpha / r, shows
_PEFT_NAME = re.compile(r"layers\.(\d+)\..*\.(\w+)\.lora_([AB])\.default\.weight$")


def lora_for(arch, targets, use_rslora: bool = False, rank: int = RANK, alpha: float = ALPHA):
    return lora_settings({"lora_rank": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "lora_target_modules": targets,
                          "lora_use_rslora": use_rslora, "norm": arch.norm, "activation": arch.activation})


def adapted_pair(family: str, targets, use_rslora: bool = False, kv_heads: int = 2):
    """(our model with adapters, PEFT's model) over the same HF base, PEFT's random adapters copied into ours."""
    base, hf = llama_pair(kv_heads) if family == "llama" else gpt_neox_pair()
    lora = lora_for(base.arch, targets, use_rslora)
    ours = build_model(base.arch, seed=1234, lora=lora)
    missing, unexpected = ours.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(".lora." in name for name in missing)
    peft = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets,
                                         use_rslora=use_rslora, lora_dropout=0.0))
    targets_of = lora.targets()
    generator = torch.Generator().manual_seed(3)
    ours_params = dict(ours.named_parameters())
    ours_name_of = {}  # PEFT's parameter name -> ours
    with torch.no_grad():
        for name, param in peft.named_parameters():
            match = _PEFT_NAME.search(name)
            if match is None:
                continue
            layer, module, side = match.groups()
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            key = f"sequential.{int(layer) + 2}.{targets_of[module].linear}.lora.{module}.lora_{side}"
            ours_params[key].copy_(param)
            ours_name_of[name] = key
    assert set(ours_name_of.values()) == {name for name in ours_params if ".lora." in name}
    return ours, peft, ours_name_of


LLAMA_SETTINGS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,
                  "pos_emb": "rotary", "norm": "rmsnorm", "activation": "swiglu", "intermediate_size": 192}
FAMILIES = [("llama", "all-linear"), ("llama", None), ("llama", ["k_proj", "gate_proj", "o_proj"]),
            ("gpt_neox", "all-linear"), ("gpt_neox", None), ("gpt_neox", ["dense", "dense_4h_to_h"])]


def _logits_of(model, batch):
    with torch.no_grad():
        out = model.eval()(input_ids=batch) if hasattr(model, "peft_config") else model.eval()(batch)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize(("family", "targets"), FAMILIES, ids=lambda v: str(v))
def test_adapted_logits_equal_peft(family, targets):
    ours, peft, _ = adapted_pair(family, targets)
    batch = tokens(batch=2, seq=10, seed=5)
    torch.testing.assert_close(_logits_of(ours, batch), _logits_of(peft, batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_heads", [4], ids=["mha"])
def test_fused_per_head_query_key_value_equals_peft_with_rank_stabilised_scaling(kv_heads):
    """One key/value head per query head interleaves q, k and v per head in our fused layer."""
    ours, peft, _ = adapted_pair("llama", ["q_proj", "k_proj", "v_proj"], use_rslora=True, kv_heads=kv_heads)
    batch = tokens(batch=2, seq=10, seed=6)
    torch.testing.assert_close(_logits_of(ours, batch), _logits_of(peft, batch), atol=1e-5, rtol=0)


def test_a_fresh_adapter_leaves_the_base_logits_exactly():
    base, _ = llama_pair()
    ours = build_model(base.arch, seed=1234, lora=lora_for(base.arch, "all-linear"))
    ours.load_state_dict(base.state_dict(), strict=False)
    adapters = {name: p for name, p in ours.named_parameters() if ".lora." in name}
    assert adapters and not any(p.any() for name, p in adapters.items() if name.endswith("lora_B"))
    for name, a in adapters.items():  # PEFT's kaiming-uniform draw (a = sqrt(5)): uniform within 1 / sqrt(in)
        if name.endswith("lora_A"):
            bound = a.shape[1] ** -0.5
            assert 0.9 * bound < a.abs().max() <= bound, name
    batch = tokens(batch=2, seq=10, seed=5)
    assert torch.equal(_logits_of(ours, batch), _logits_of(base, batch))


def test_adapters_leave_the_base_draws_of_a_seed_as_they_were():
    base, _ = llama_pair()
    plain = build_model(base.arch, seed=99).state_dict()
    adapted = build_model(base.arch, seed=99, lora=lora_for(base.arch, "all-linear")).state_dict()
    assert set(adapted) - set(plain) and all(torch.equal(adapted[name], value) for name, value in plain.items())


def _one_batch_loss(logits, batch):
    return causal_lm_loss(logits, batch[:, 1:])


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_the_first_step_of_a_deepspeed_engine_moves_each_adapter_by_peft_gradient_and_nothing_else(family):
    """fp32, ZeRO 0, SGD at learning rate 1: the step's change of every A and B is PEFT's gradient; the
    base weights have no gradient and do not move."""
    ours, peft, ours_name_of = adapted_pair(family, "all-linear")
    batch = tokens(batch=2, seq=10, seed=7)
    peft.train()
    _one_batch_loss(peft(input_ids=batch[:, :-1]).logits, batch).backward()
    expected = {ours_name_of[name]: p.grad for name, p in peft.named_parameters() if name in ours_name_of}
    before = {name: p.detach().clone() for name, p in ours.named_parameters()}
    groups = build_param_groups(ours, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=ours, optimizer=torch.optim.SGD(groups, lr=1.0),
                                      config={"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 0.0})
    engine.backward(_one_batch_loss(engine(batch[:, :-1]), batch))
    base_grads = [name for name, p in ours.named_parameters() if name not in expected and p.grad is not None]
    engine.step()
    assert not base_grads
    for name, param in ours.named_parameters():
        if name in expected:
            assert expected[name].abs().sum() > 0, name
            torch.testing.assert_close(before[name] - param.detach(), expected[name], atol=1e-5, rtol=0, msg=name)
        else:
            assert torch.equal(param, before[name]), name


def _sgd_engine(model):
    return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(build_param_groups(model, 0.0), lr=1.0),
                                config={"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                                        "gradient_clipping": 0.0})[0]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_dpo_with_lora_compares_with_the_base_as_peft_with_its_adapter_disabled(family):
    """The reference of a LoRA DPO run is the policy's own base: the loss and the adapters' first step equal
    DPO computed on PEFT's model against itself under `disable_adapter()`, with trained (non-zero) adapters."""
    ours, peft, ours_name_of = adapted_pair(family, "all-linear")
    samples, beta = pairs(), 0.5
    peft.train()
    chosen = hf_sequence_log_probs(peft, samples["pos"], samples["pos_label"])
    rejected = hf_sequence_log_probs(peft, samples["neg"], samples["neg_label"])
    with torch.no_grad(), peft.disable_adapter():
        reference_chosen = hf_sequence_log_probs(peft, samples["pos"], samples["pos_label"])
        reference_rejected = hf_sequence_log_probs(peft, samples["neg"], samples["neg_label"])
    expected_loss = -torch.nn.functional.logsigmoid(
        beta * ((chosen - reference_chosen) - (rejected - reference_rejected))).mean()
    expected_loss.backward()
    expected = {ours_name_of[name]: p.grad for name, p in peft.named_parameters() if name in ours_name_of}

    before = {name: p.detach().clone() for name, p in ours.named_parameters()}
    engine = _sgd_engine(ours)
    objective = DirectPreferenceOptimization(BatchOptions(), beta, fp32=True, reference=BaseWithoutAdapters(engine))
    loss, _ = objective(engine, samples)
    assert engine.module.training  # the reference's forward ran in eval mode and gave the mode back
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
    assert abs(loss.item() - math.log(2)) > 1e-3  # the adapters are not zero: the policy is not its reference
    engine.backward(loss)
    engine.step()
    for name, param in ours.named_parameters():
        if name in expected:
            torch.testing.assert_close(before[name] - param.detach(), expected[name], atol=1e-5, rtol=1e-4, msg=name)
        else:
            assert torch.equal(param, before[name]), name


def test_the_base_without_adapters_computes_the_base_and_leaves_the_adapters_on_after():
    ours, _, _ = adapted_pair("llama", "all-linear")
    base = build_model(ours.arch, seed=1234)
    base.load_state_dict({name: value for name, value in ours.state_dict().items() if ".lora." not in name})
    engine = _sgd_engine(ours)
    batch = tokens(batch=2, seq=10, seed=8)
    adapted = engine(batch)
    assert torch.equal(BaseWithoutAdapters(engine)(batch), _logits_of(base, batch))
    assert torch.equal(engine(batch), adapted) and not torch.equal(adapted, _logits_of(base, batch))


def test_a_lora_reward_model_trains_its_new_scalar_head_beside_the_adapters():
    args = NeoXArgs.from_dict({**LLAMA_SETTINGS, "lora_rank": 4, "lora_target_modules": "all-linear", "train_impl": "rm", "no_weight_tying": True,
                               "dataset_impl": "pairwise", "pack_impl": "unpacked", "padded_vocab_size": 128})
    model = build_model(args.architecture(), seed=3, lora=args.lora())
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    head = {name for name in trained if ".lora." not in name}
    assert head == {f"sequential.{LLAMA_SETTINGS['num_layers'] + 4}.{name}"
                    for name, _ in model.reward_head.named_parameters()}
    assert len(trained - head) == 2 * 7 * LLAMA_SETTINGS["num_layers"]  # A and B of 7 modules in each layer


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_keeps_fp32_masters_of_the_adapters_alone(stage):
    """DeepSpeed PR #8029: bf16 without ZeRO made fp32 masters of frozen weights. Here the optimizer is
    given the trainable parameters alone, so at every stage its masters are the adapters'."""
    base, _ = llama_pair()
    model = build_model(base.arch, seed=1234, lora=lora_for(base.arch, None))
    adapters = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora." in name for name in adapters)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=build_param_groups(model, 0.0), config=config)
    held: dict[str, int] = {}
    for fragment in master_fragments(engine):
        held[fragment.name] = held.get(fragment.name, 0) + fragment.master.numel()
    assert held == adapters


@pytest.mark.parametrize(("settings", "message"), [
    ({"lora_target_modules": ["q_proj", "query_key_value"]},
     "lora_target_modules: 'query_key_value' names no linear module of this Llama-family model; use some of "
     "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or 'all-linear'"),
    ({"lora_target_modules": []}, "an empty list names no linear module"),
    ({"lora_alpha": 0}, "lora_alpha: must be positive"),
    ({"lora_dropout": 1.0}, "lora_dropout: must be in [0, 1)"),
])
def test_bad_lora_settings_get_one_line(settings, message):
    with pytest.raises(ConfigError) as caught:
        NeoXArgs.from_dict({**LLAMA_SETTINGS, "lora_rank": 4, **settings}, "run.yml")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_lora_settings_read_numbers_as_yaml_strings_and_resolve_peft_defaults():
    args = NeoXArgs.from_dict({**LLAMA_SETTINGS, "lora_rank": "16", "lora_alpha": "3.2e1", "lora_dropout": "5e-2"})
    lora = args.lora()
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (16, 32.0, 0.05, ("q_proj", "v_proj"))
    assert lora.scaling == 2.0
    assert NeoXArgs.from_dict({**LLAMA_SETTINGS, "lora_rank": 16, "lora_use_rslora": True}).lora().scaling == 2.0
    assert NeoXArgs.from_dict(LLAMA_SETTINGS).lora() is None
    neox = NeoXArgs.from_dict({**LLAMA_SETTINGS, "norm": "layernorm", "activation": "gelu", "lora_rank": 2})
    assert neox.lora().target_modules == ("query_key_value",)
