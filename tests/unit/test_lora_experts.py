"""LoRA on a Mixtral's experts against PEFT itself: ``target_parameters`` on transformers' fused expert parameters.

The reference is PEFT's model over transformers' MixtralForCausalLM from the same folder, its adapters set to
random values and copied into ours by the test's own reading of PEFT's layout (A [experts x r, in], expert by
expert; B [out, r x experts], column i x experts + e of it column i of expert e's B). The first step's loss and
the gradient of every A and B are PEFT's, in the grouped and in the one-by-one expert path.
"""

from __future__ import annotations

import re

import pytest
import torch

import megatron.model.moe as moe
from megatron.hf import load_hf_module_weights
from megatron.model import build_model, causal_lm_loss
from megatron.model.lora import adapters_switched_off
from megatron.neox_arguments import ConfigError, NeoXArgs
from tests.e2e.test_hf_conversion import our_args

pytestmark = pytest.mark.usefixtures("single_rank_world")

VOCAB, EXPERTS, TOP_K, WIDTH, SEQ = 128, 4, 2, 48, 32
RANK, ALPHA = 2, 6  # scaling 3
TARGETS = ["q_proj", "experts.gate_up_proj", "experts.down_proj"]
# PEFT's parameter names: module, then (for a parameter wrapper inside another) base_layer
_PEFT_NAME = re.compile(r"layers\.(\d+)\.(self_attn\.q_proj|mlp\.experts(?:\.base_layer)?)\.lora_([AB])\.default\.weight$")


def save_mixtral(folder, vocab: int = VOCAB):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=WIDTH, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=64,
        tie_word_embeddings=False))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


def our_b(peft_b: torch.Tensor) -> torch.Tensor:
    """PEFT's B of an expert parameter [out, r x experts] as ours, each expert's B [out, r] stacked."""
    per_expert = peft_b.view(peft_b.shape[0], RANK, EXPERTS)
    return torch.cat([per_expert[:, :, expert] for expert in range(EXPERTS)])


def our_name(layer: str, module: str, side: str, targets: list[str]) -> str:
    prefix = f"sequential.{int(layer) + 2}."
    if module == "self_attn.q_proj":
        return f"{prefix}attention.query_key_value.lora.q_proj.lora_{side}"
    # PEFT wraps gate_up_proj first: with both parameters adapted its wrapper is the inner one, under base_layer
    experts = [target.removeprefix("experts.") for target in targets if target.startswith("experts.")]
    parameter = experts[0] if len(experts) == 1 else "gate_up_proj" if module.endswith("base_layer") else "down_proj"
    return f"{prefix}mlp.experts.mlp.lora.{parameter}.lora_{side}"


def adapted_pair(hf_dir, targets):
    """(our model, PEFT's) over the same folder, PEFT's random adapters copied into ours; PEFT name -> ours."""
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralForCausalLM

    args = our_args(hf_dir, lora_rank=RANK, lora_alpha=ALPHA, lora_target_modules=targets)
    ours = build_model(args.architecture(), seed=1, lora=args.lora())
    missing, unexpected = ours.load_state_dict(load_hf_module_weights(hf_dir, args.architecture()), strict=False)
    assert not unexpected and missing and all(".lora." in name for name in missing)
    peft = get_peft_model(MixtralForCausalLM.from_pretrained(hf_dir), LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=[t for t in targets if "." not in t],
        target_parameters=[t for t in targets if "." in t]))
    generator, params, name_of = torch.Generator().manual_seed(3), dict(ours.named_parameters()), {}
    with torch.no_grad():
        for name, param in peft.named_parameters():
            match = _PEFT_NAME.search(name)
            if match is None:
                continue
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            layer, module, side = match.groups()
            name_of[name] = our_name(layer, module, side, targets)
            expert_b = module.startswith("mlp.experts") and side == "B"
            params[name_of[name]].copy_(our_b(param) if expert_b else param)
    assert set(name_of.values()) == set(missing)
    return ours, peft, name_of


def loss_and_adapter_grads(model, batch, is_peft: bool, name_of: dict[str, str]):
    model.train()
    logits = model(input_ids=batch[:, :-1]).logits if is_peft else model(batch[:, :-1])
    loss = causal_lm_loss(logits, batch[:, 1:])
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        assert ".lora" in name or "lora_" in name, f"{name}: the frozen base got a gradient"
        key = name_of.get(name, name)
        expert_b = is_peft and "mlp.experts" in name and "lora_B" in name
        grads[key] = our_b(param.grad) if expert_b else param.grad
    return loss.detach(), grads


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return save_mixtral(tmp_path_factory.mktemp("mixtral") / "hf")


@pytest.mark.parametrize("targets", [TARGETS, ["experts.down_proj"]], ids=["attention+both experts", "down only"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "one by one"])
def test_adapters_on_the_experts_take_pefts_first_step(mixtral_dir, targets, grouped, monkeypatch):
    ours, peft, name_of = adapted_pair(mixtral_dir, targets)
    if not grouped:  # the path taken where torch's grouped matmul does not run
        monkeypatch.setattr(moe, "grouped_matmul_runs", lambda *shape: False)
    batch = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(4))
    expected_loss, expected = loss_and_adapter_grads(peft, batch, True, name_of)
    loss, grads = loss_and_adapter_grads(ours, batch, False, {})
    assert sorted(grads) == sorted(expected) and any("experts" in name for name in grads)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_switched_off_the_expert_adapters_leave_the_base(mixtral_dir):
    from transformers import MixtralForCausalLM

    ours, _, _ = adapted_pair(mixtral_dir, TARGETS)
    batch = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = MixtralForCausalLM.from_pretrained(mixtral_dir).eval()(input_ids=batch).logits
        adapted = ours.eval()(batch)
        with adapters_switched_off(ours):
            base = ours(batch)
    assert (adapted - expected).abs().max() > 1e-2
    torch.testing.assert_close(base, expected, atol=1e-5, rtol=0)


MOE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": SEQ, "pos_emb": "rotary",
       "norm": "rmsnorm", "activation": "swiglu", "moe_num_experts": EXPERTS, "moe_top_k": TOP_K,
       "moe_intermediate_size": WIDTH, "intermediate_size": 96, "lora_rank": RANK}
DENSE = {key: value for key, value in MOE.items() if not key.startswith("moe_")}


def test_all_linear_on_experts_is_the_attention_and_the_experts_are_named_as_peft_targets_them():
    lora = NeoXArgs.from_dict({**MOE, "lora_target_modules": "all-linear"}).lora()
    assert lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj") and not lora.adapts_experts
    lora = NeoXArgs.from_dict({**MOE, "lora_target_modules": ["experts.down_proj", "o_proj",
                                                              "experts.gate_up_proj"]}).lora()
    assert lora.target_modules == ("o_proj", "experts.gate_up_proj", "experts.down_proj") and lora.adapts_experts
    assert NeoXArgs.from_dict({**DENSE, "lora_target_modules": "all-linear"}).lora().target_modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize(("model", "settings", "message"), [
    (MOE, {"lora_target_modules": ["experts.gate_up_proj", "down_proj"]},
     "lora_target_modules: 'down_proj' names no linear module of this Llama-family mixture-of-experts model; use "
     "some of q_proj, k_proj, v_proj, o_proj, experts.gate_up_proj, experts.down_proj, or 'all-linear'"),
    (DENSE, {"lora_target_modules": ["experts.down_proj"]},
     "'experts.down_proj' names no linear module of this Llama-family model"),
    (MOE, {"lora_target_modules": ["experts.down_proj"], "lora_dropout": 0.1},
     "lora_dropout: is 0.1, but an expert parameter's adapter adds to the weight"),
    (MOE, {"lora_target_modules": ["experts.down_proj"], "lora_rank": 49}, "adapted layer experts.down_proj (32 x 48)"),
])
def test_bad_expert_targets_get_one_line(model, settings, message):
    with pytest.raises(ConfigError) as caught:
        NeoXArgs.from_dict({**model, **settings}, "run.yml")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_gpt_neox_shaped_model_with_experts_adapts_its_attention():
    args = NeoXArgs.from_dict({"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": SEQ,
                               "moe_num_experts": EXPERTS, "moe_top_k": TOP_K, "moe_router_type": "topk",
                               "use_bias_in_mlp": False, "lora_rank": RANK, "lora_target_modules": "all-linear",
                               "padded_vocab_size": VOCAB})
    assert args.lora().target_modules == ("query_key_value", "dense")
    model = build_model(args.architecture(), seed=1, lora=args.lora())
    trained = [name for name, param in model.named_parameters() if param.requires_grad]
    assert len(trained) == 2 * 2 * 2 and all(".attention." in name and ".lora." in name for name in trained)
    assert model(torch.randint(0, VOCAB, (2, SEQ))).shape == (2, SEQ, VOCAB)
