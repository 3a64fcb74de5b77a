"""Mixtures of experts from Hugging Face folders against transformers itself: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Each tiny model is built with transformers' own classes and saved by save_pretrained (the kinds of
tests/e2e/test_hf_conversion.py, which also checks their logits and round trips). Here: the routing's
renormalisation is what makes the logits equal (the other choice is far off), and one step of a real DeepSpeed
engine started from the folder, with the load-balancing loss the config asks for, has transformers' loss,
load-balancing loss and gradient of every parameter, the routers' and the experts' included.
"""

from __future__ import annotations

import pytest
import torch
from transformers.core_model_loading import revert_weight_conversion

from megatron.data import BatchOptions
from megatron.hf import HFConversionError, load_hf_module_weights
from megatron.hf.config import spec_from_hf_config, unrepresentable
from megatron.hf.mapping import convert_tensors, hf_to_ours
from megatron.model import build_model, load_balancing_loss
from megatron.model.partitioning import REPLICATED, partitioning
from megatron.objectives import objective_for
from tests.e2e.test_hf_conversion import MOE_KINDS, logits_of, make_hf_model, our_args, save_hf
from tests.unit.test_hf_families import engine_from_folder, long_tokens

pytestmark = pytest.mark.usefixtures("single_rank_world")


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_logits_equal_transformers_and_not_with_the_other_renormalisation(kind, tmp_path):
    model = make_hf_model(kind)
    hf_dir = save_hf(model, tmp_path / "hf")
    args = our_args(hf_dir)
    weights = load_hf_module_weights(hf_dir, args.architecture())
    batch = long_tokens()
    with torch.no_grad():
        expected = model(batch).logits
    for renormalised in (args.moe_norm_topk_prob, not args.moe_norm_topk_prob):
        ours = build_model(our_args(hf_dir, moe_norm_topk_prob=renormalised).architecture(), args.seed).eval()
        ours.load_state_dict(weights, strict=True)
        with torch.no_grad():
            difference = (logits_of(ours, batch) - expected).abs().max().item()
        if renormalised == args.moe_norm_topk_prob:
            assert difference <= 1e-5
        else:
            assert difference > 1e-2, f"{kind}: renormalising or not changes nothing"


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"])
def test_one_step_from_the_folder_has_the_loss_and_gradient_of_transformers_with_load_balancing(kind, tmp_path):
    model = make_hf_model(kind)
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.02
    args, engine = engine_from_folder(model, tmp_path)
    batch = long_tokens(seed=1)
    loss, metrics = objective_for(args, BatchOptions())(engine, {"text": batch})
    engine.backward(loss)

    model.train()
    # the same inputs and targets: transformers' loss with the targets given unshifted (shift_labels)
    targets = batch[:, 1:].contiguous()
    expected = model(input_ids=batch[:, :-1], labels=targets, shift_labels=targets)
    expected.loss.backward()
    assert metrics["load_balancing_loss"].item() == pytest.approx(expected.aux_loss.item(), rel=1e-6)
    assert 0.02 * expected.aux_loss.item() > 1e-3 * expected.loss.item()  # far above the tolerance below
    assert loss.item() == pytest.approx(expected.loss.item(), rel=1e-6)
    spec = spec_from_hf_config(model.config.to_dict())
    hf_grads = revert_weight_conversion(model, {name: p.grad for name, p in model.named_parameters()})
    expected_grads = convert_tensors(hf_grads.items(), hf_to_ours(spec.family, spec.architecture()), "grads")
    ours = {name: p.grad.cpu() for name, p in engine.module.named_parameters()}
    assert sorted(ours) == sorted(expected_grads)
    assert any(name.endswith("mlp.router.layer.weight") for name in ours)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    # every expert's load: its share of the layer's top-k choices, as transformers' router chose them
    top_k = model.config.num_experts_per_tok
    experts = len(expected.router_logits[0][0])
    expected_loads = {}
    for layer, logits in enumerate(expected.router_logits):
        chosen = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices
        for expert in range(experts):
            expected_loads[f"expert_load/layer_{layer}/expert_{expert}"] = (chosen == expert).sum().item() / chosen.numel()
    loads = {name: value.item() for name, value in metrics.items() if name.startswith("expert_load/")}
    assert loads == pytest.approx(expected_loads, abs=1e-7)  # counts over the same slots: float32 apart
    assert len(set(expected_loads.values())) > 2  # the routing is uneven: shares that tell experts apart


def test_the_load_balancing_loss_is_top_k_for_balanced_routing_and_grows_as_routing_collapses():
    """Transformers' formula on known values: with each expert's mean probability and share of the choices
    equal the loss is top_k; with every token sent to the same two experts, num_experts / 2 x top_k."""
    experts, top_k = 4, 2
    spread = torch.log(torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])).repeat(4, 1)
    assert load_balancing_loss([spread], experts, top_k).item() == pytest.approx(top_k * 1.0, rel=1e-6)
    collapsed = torch.tensor([[9.0, 9.0, -9.0, -9.0]]).repeat(8, 1)
    assert load_balancing_loss([collapsed], experts, top_k).item() == pytest.approx(experts / 2 * top_k, rel=1e-3)


def test_recomputed_layers_give_the_same_loss_and_gradient_with_the_load_balancing_loss(tmp_path):
    """checkpoint_activations recomputes each layer in the backward, appending its router logits again to a list
    whose loss is already taken: the step is the same."""
    hf_dir = save_hf(make_hf_model("mixtral"), tmp_path / "hf")
    weights = load_hf_module_weights(hf_dir, our_args(hf_dir).architecture())
    results = []
    for recompute in (False, True):
        args = our_args(hf_dir, checkpoint_activations=recompute)
        model = build_model(args.architecture(), args.seed)
        model.load_state_dict(weights, strict=True)
        loss, metrics = objective_for(args, BatchOptions())(model.train(), {"text": long_tokens(seed=2)})
        loss.backward()
        results.append((loss.item(), metrics["load_balancing_loss"].item(),
                        {name: p.grad.clone() for name, p in model.named_parameters()}))
    (plain_loss, plain_balance, plain_grads), (loss, balance, grads) = results
    assert (loss, balance) == (plain_loss, plain_balance)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(("kind", "change", "expected"), [
    ("qwen3_moe", dict(decoder_sparse_step=2), r"decoder_sparse_step=2 .* give experts to layers \[1\]; only layers 0, k"),
    ("qwen2_moe", dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\] give experts to layers \[1\]; only layers 0, k"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared expert needs a positive width"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0 clamps .* not built"),
    ("mixtral", dict(router_jitter_noise=0.1), "router jitter is not built"),
])
def test_experts_we_cannot_build_are_refused_in_one_line(kind, change, expected):
    config = {**make_hf_model(kind).config.to_dict(), **change}
    with pytest.raises(HFConversionError, match=expected):
        spec_from_hf_config(config)


def test_a_model_with_experts_is_written_only_as_a_family_with_experts():
    arch = spec_from_hf_config(make_hf_model("mixtral").config.to_dict()).architecture()
    assert unrepresentable(arch, "mixtral") == []
    assert any("mistral has no experts" in problem for problem in unrepresentable(arch, "mistral"))
    assert "moe_norm_topk_prob=False (mixtral needs True)" in unrepresentable(
        spec_from_hf_config(make_hf_model("qwen3_moe_unnormalised").config.to_dict()).architecture(), "mixtral")
    qwen2_moe, olmoe = (spec_from_hf_config(make_hf_model(kind).config.to_dict()).architecture()
                        for kind in ("qwen2_moe", "olmoe"))
    assert qwen2_moe.moe_expert_interval == 2  # mlp_only_layers [1] of 2 layers
    assert unrepresentable(qwen2_moe, "qwen2_moe") == unrepresentable(olmoe, "olmoe") == []
    assert "moe_shared_expert_intermediate_size=48 (qwen3_moe needs 0)" in unrepresentable(qwen2_moe, "qwen3_moe")
    assert "moe_expert_interval=2 (mixtral needs 1)" in unrepresentable(qwen2_moe, "mixtral")
    assert "qk_layernorm_across_heads=True (qwen3_moe needs False)" in unrepresentable(olmoe, "qwen3_moe")
    assert "moe_shared_expert_intermediate_size=0 (qwen2_moe has a shared expert)" in unrepresentable(olmoe, "qwen2_moe")


def test_the_shared_expert_is_drawn_and_split_as_a_dense_mlp_and_its_gate_starts_closed_halfway():
    """Qwen2-MoE's layer 0 has experts and a shared expert, its layer 1 a dense MLP: the shared expert's weights
    split over tensor-parallel ranks as the dense MLP's do and are drawn at initialisation; its gate is replicated
    and starts at zero (sigmoid 1/2) whatever the tensor-parallel size."""
    arch = spec_from_hf_config(make_hf_model("qwen2_moe").config.to_dict()).architecture()
    params = dict(build_model(arch, seed=0).named_parameters())
    for linear in ("linear1", "linear2"):
        shared, dense = f"sequential.2.mlp.shared_expert.mlp.{linear}.weight", f"sequential.3.mlp.{linear}.weight"
        assert partitioning(shared, arch) == partitioning(dense, arch) != REPLICATED
        assert 0.5 < params[shared].std().item() / params[dense].std().item() < 2
    gate = "sequential.2.mlp.shared_expert_gate.weight"
    assert partitioning(gate, arch) == REPLICATED and not params[gate].any()
