"""GPTModel: shapes, causality, parameter names, fused layouts, residual modes, rotary, init, training."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.checkpointing.formats.legacy_names import is_legacy_buffer_key, translate_legacy_key
from megatron.contract.architecture import architecture_from_settings
from megatron.model import (
    GPTModel,
    ModelConfigError,
    build_model,
    causal_lm_loss,
    no_weight_decay_param_names,
)
from megatron.model.attention import sliding_window_mask
from megatron.model.mlp import swiglu
from megatron.model.rotary import RotaryEmbedding, split_qkv
from megatron.neox_arguments import NeoXArgs

pytestmark = pytest.mark.usefixtures("single_rank_world")

VOCAB = 128
HIDDEN = 64
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
SEQ = 12

NEOX = dict(
    pos_emb="rotary",
    rotary_pct=0.25,
    gpt_j_residual=True,
    no_weight_tying=True,
    norm="layernorm",
    activation="gelu",
)
LLAMA = dict(
    pos_emb="rotary",
    rotary_pct=1.0,
    rotary_emb_base=500000,
    gpt_j_residual=False,
    norm="rmsnorm",
    rms_norm_epsilon=1e-6,
    activation="swiglu",
    intermediate_size=3 * 96,  # GPT-NeoX's rule: 96 per projection
    num_kv_heads=2,
    use_bias_in_norms=False,
    use_bias_in_attn_linear=False,
    use_bias_in_mlp=False,
)


def tiny_args(family: dict | None = None, **overrides) -> NeoXArgs:
    values = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        seq_length=SEQ,
        padded_vocab_size=VOCAB,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        seed=1234,
    )
    values.update(family or {})
    values.update(overrides)
    return NeoXArgs.from_dict(values)


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def randomize_(model: torch.nn.Module, seed: int = 7) -> None:
    """Give every parameter (biases and norm weights included) random values, so no term can hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0) * 0.5)


# ---------------------------------------------------------------- hand-written references


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [s, heads, d], k/v [s, kv_heads, d] -> [s, heads * d]; explicit loops, causal, 1/sqrt(d)."""
    s, heads, d = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(s, heads, d, dtype=torch.float64)
    for h in range(heads):
        kv = h // group
        for i in range(s):
            scores = torch.stack([q[i, h].double() @ k[j, kv].double() for j in range(i + 1)]) / math.sqrt(d)
            probs = torch.softmax(scores, dim=0)
            out[i, h] = sum(probs[j] * v[j, kv].double() for j in range(i + 1))
    return out.reshape(s, heads * d)


def reference_rotary(x: torch.Tensor, ndims: int, base: float) -> torch.Tensor:
    """x [s, heads, d]: rotate pairs (j, j + ndims/2) of the first ndims dims by angle pos / base^(2j/ndims)."""
    out = x.clone().double()
    half = ndims // 2
    for pos in range(x.shape[0]):
        for j in range(half):
            angle = pos / base ** (2 * j / ndims)
            a, b = x[pos, :, j].double(), x[pos, :, j + half].double()
            out[pos, :, j] = a * math.cos(angle) - b * math.sin(angle)
            out[pos, :, j + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def reference_qkv(layer, x: torch.Tensor, heads: int, kv_heads: int):
    """Separate q, k, v [s, heads, d] sliced from the fused weight by the documented layout."""
    w = layer.attention.query_key_value.weight
    b = layer.attention.query_key_value.bias
    d = HEAD_DIM
    if kv_heads == heads:  # per head [q, k, v]
        w_heads = w.view(heads, 3, d, -1)
        wq, wk, wv = (w_heads[:, i].reshape(heads * d, -1) for i in range(3))
        bq, bk, bv = (None,) * 3 if b is None else (b.view(heads, 3, d)[:, i].reshape(-1) for i in range(3))
    else:  # all q heads, all k heads, all v heads
        wq, wk, wv = w.split([heads * d, kv_heads * d, kv_heads * d])
        bq, bk, bv = (None,) * 3 if b is None else b.split([heads * d, kv_heads * d, kv_heads * d])
    q = F.linear(x, wq, bq).view(-1, heads, d)
    k = F.linear(x, wk, bk).view(-1, kv_heads, d)
    v = F.linear(x, wv, bv).view(-1, kv_heads, d)
    return q, k, v


def reference_mlp(layer, x: torch.Tensor, activation: str) -> torch.Tensor:
    w1, b1 = layer.mlp.linear1.weight, layer.mlp.linear1.bias
    if activation == "swiglu":
        inner = w1.shape[0] // 2
        up = F.linear(x, w1[:inner], None if b1 is None else b1[:inner])
        gate = F.linear(x, w1[inner:], None if b1 is None else b1[inner:])
        act = gate * torch.sigmoid(gate) * up
    else:
        pre = F.linear(x, w1, b1)
        act = 0.5 * pre * (1.0 + torch.erf(pre / math.sqrt(2.0)))
    return F.linear(act, layer.mlp.linear2.weight, layer.mlp.linear2.bias)


# ---------------------------------------------------------------- shapes, causality, names


@pytest.mark.parametrize("family", [NEOX, LLAMA], ids=["neox", "llama"])
def test_forward_gives_logits_of_padded_vocab_in_param_dtype(family):
    model = build_model(tiny_args(family).architecture(), 1234)
    logits = model(tokens())
    assert logits.shape == (2, SEQ, VOCAB)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model.to(torch.bfloat16)(tokens()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "family", [NEOX, LLAMA, dict(NEOX, pos_emb="learned")], ids=["neox", "llama", "learned"]
)
def test_changing_a_later_token_never_changes_an_earlier_logit(family):
    model = build_model(tiny_args(family).architecture(), 1234).eval()
    randomize_(model)
    ids = tokens(batch=1)
    changed = ids.clone()
    changed[0, 7] = (changed[0, 7] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def expected_names(num_layers: int, llama: bool, tied: bool, learned: bool = False) -> set[str]:
    names = {"sequential.0.word_embeddings.weight"}
    if learned:
        names.add("sequential.0.position_embeddings.weight")
    norm_params = ("scale",) if llama else ("weight", "bias")
    linear_params = ("weight",) if llama else ("weight", "bias")
    for i in range(num_layers):
        prefix = f"sequential.{i + 2}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            names |= {f"{prefix}{norm}.{p}" for p in norm_params}
        for linear in ("attention.query_key_value", "attention.dense", "mlp.linear1", "mlp.linear2"):
            names |= {f"{prefix}{linear}.{p}" for p in linear_params}
    names |= {f"sequential.{num_layers + 3}.norm.{p}" for p in norm_params}
    if not tied:
        names.add(f"sequential.{num_layers + 4}.final_linear.weight")
    return names


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("llama", [False, True], ids=["neox", "llama"])
def test_state_dict_holds_exactly_gpt_neox_parameter_names(llama, tied):
    family = LLAMA if llama else NEOX
    model = build_model(tiny_args(family, num_layers=3, no_weight_tying=not tied).architecture(), 0)
    assert set(model.state_dict()) == expected_names(3, llama, tied)
    assert {name for name, _ in model.named_parameters()} == expected_names(3, llama, tied)
    model.load_state_dict(model.state_dict(), strict=True)


def test_learned_position_embedding_is_named_like_gpt_neox_and_sized_by_max_positions():
    model = build_model(tiny_args(NEOX, pos_emb="learned", max_position_embeddings=20).architecture(), 0)
    assert set(model.state_dict()) == expected_names(2, llama=False, tied=False, learned=True)
    assert model.state_dict()["sequential.0.position_embeddings.weight"].shape == (20, HIDDEN)
    with pytest.raises(ModelConfigError, match="max_position_embeddings=20"):
        model(tokens(seq=21))


def test_tied_logits_use_the_word_embedding():
    model = build_model(tiny_args(LLAMA, no_weight_tying=False).architecture(), 1234).eval()
    randomize_(model)
    with torch.no_grad():
        hidden = model.embedding(tokens(), torch.arange(SEQ).unsqueeze(0))
        cos_sin = model.rotary.cos_sin(torch.arange(SEQ).unsqueeze(0), hidden.dtype)
        for layer in model.layers:
            hidden = layer(hidden, cos_sin)
        hidden = model.sequential["5"](hidden)
        expected = hidden @ model.sequential["0"].word_embeddings.weight.T
        assert torch.allclose(model(tokens()), expected, atol=1e-5)


# ---------------------------------------------------------------- fused layouts against references


@pytest.mark.parametrize("kv_heads", [HEADS, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_fused_qkv_layout_matches_reference_attention_from_separate_slices(kv_heads):
    args = tiny_args(NEOX, pos_emb="none", num_kv_heads=kv_heads, use_bias_in_attn_linear=True)
    layer = build_model(args.architecture(), 0).layers[0]
    randomize_(layer)
    x = torch.randn(1, 6, HIDDEN, generator=torch.Generator().manual_seed(3))
    q, k, v = reference_qkv(layer, x[0], HEADS, kv_heads)
    attended = reference_attention(q, k, v).float()
    expected = F.linear(attended, layer.attention.dense.weight, layer.attention.dense.bias)
    with torch.no_grad():
        actual = layer.attention(x, None)[0]
    assert torch.allclose(actual, expected, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa"])
def test_rotary_attention_matches_reference_rotation(kv_heads):
    args = tiny_args(NEOX, rotary_pct=0.5, rotary_emb_base=100, num_kv_heads=kv_heads)
    model = build_model(args.architecture(), 0)
    layer = model.layers[0]
    randomize_(layer)
    x = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(4))
    q, k, v = reference_qkv(layer, x[0], HEADS, kv_heads)
    ndims = HEAD_DIM // 2
    q, k = reference_rotary(q, ndims, 100), reference_rotary(k, ndims, 100)
    expected = F.linear(
        reference_attention(q, k, v).float(), layer.attention.dense.weight, layer.attention.dense.bias
    )
    with torch.no_grad():
        actual = layer.attention(x, model.rotary.cos_sin(torch.arange(5), x.dtype))[0]
    assert torch.allclose(actual, expected, atol=1e-5)


def _fused_from_heads(q, k, v):
    """q, k, v [b, s, heads, d] (equal head counts) -> the per-head [q, k, v] fused layout [b, s, 3 * heads * d]."""
    b, s, h, d = q.shape
    return torch.stack([q, k, v], dim=3).reshape(b, s, h * 3 * d)


def test_rotary_pct_below_one_rotates_only_the_first_dims():
    ndims = 4
    rotary = RotaryEmbedding(ndims, base=10000)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 6, 2, HEAD_DIM, generator=gen) for _ in range(3))
    out_q, out_k, out_v = split_qkv(_fused_from_heads(q, k, v), 2, 2, HEAD_DIM, False,
                                    rotary.cos_sin(torch.arange(6), q.dtype))
    x = q.transpose(1, 2)  # [b, heads, s, d], as split_qkv returns
    assert torch.equal(out_q[..., ndims:], x[..., ndims:])
    assert torch.equal(out_q[:, :, 0], x[:, :, 0])  # position 0 is the identity
    assert not torch.allclose(out_q[:, :, 1:, :ndims], x[:, :, 1:, :ndims])
    expected = reference_rotary(q[0], ndims, 10000).transpose(0, 1).float()
    assert torch.allclose(out_q[0], expected, atol=1e-6)
    assert torch.allclose(out_k[0], reference_rotary(k[0], ndims, 10000).transpose(0, 1).float(), atol=1e-6)
    assert torch.equal(out_v, v.transpose(1, 2))  # values are never rotated


def _autograd_reference_split(fused, heads, kv_heads, grouped, cos, sin):
    """The plain-autograd formulation split_qkv replaces: views, chunk, rotate_half with cat."""
    b, s, _ = fused.shape
    d = HEAD_DIM
    if grouped:
        q, k, v = fused.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k, v = q.view(b, s, heads, d), k.view(b, s, kv_heads, d), v.view(b, s, kv_heads, d)
    else:
        q, k, v = fused.view(b, s, heads, 3 * d).chunk(3, dim=-1)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def rotate(x):
        half = cos.shape[-1]
        rot, passed = x[..., :2 * half], x[..., 2 * half:]
        first, second = rot.chunk(2, dim=-1)
        cos_full, sin_full = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)
        return torch.cat((rot * cos_full + torch.cat((-second, first), -1) * sin_full, passed), -1)

    return rotate(q), rotate(k), v


@pytest.mark.parametrize("kv_heads,rotary_pct", [(HEADS, 1.0), (HEADS, 0.25), (2, 0.5)],
                         ids=["mha-full", "mha-quarter", "gqa-half"])
def test_split_qkv_forward_and_gradients_equal_the_autograd_formulation(kv_heads, rotary_pct):
    grouped = kv_heads < HEADS
    ndims = int(HEAD_DIM * rotary_pct)
    cos, sin = RotaryEmbedding(ndims, base=100).cos_sin(torch.arange(7), torch.float32)
    width = (HEADS + 2 * kv_heads) * HEAD_DIM
    fused = torch.randn(2, 7, width, generator=torch.Generator().manual_seed(8), requires_grad=True)
    weights = [torch.randn(2, n, 7, HEAD_DIM, generator=torch.Generator().manual_seed(9 + i))
               for i, n in enumerate((HEADS, kv_heads, kv_heads))]

    ours = split_qkv(fused, HEADS, kv_heads, HEAD_DIM, grouped, (cos, sin))
    (ours_grad,) = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ours, weights, strict=True)), fused)
    reference = _autograd_reference_split(fused, HEADS, kv_heads, grouped, cos, sin)
    (reference_grad,) = torch.autograd.grad(sum((r * w).sum() for r, w in zip(reference, weights, strict=True)), fused)

    for a, b in zip(ours, reference, strict=True):
        assert torch.equal(a, b)  # the same operations in the same order: bit for bit
    assert torch.allclose(ours_grad, reference_grad, atol=1e-6)


def test_swiglu_linear1_holds_up_then_gate():
    layer = build_model(tiny_args(LLAMA).architecture(), 0).layers[0]
    randomize_(layer)
    assert layer.mlp.linear1.weight.shape == (2 * 96, HIDDEN)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        actual = layer.mlp(x)
        assert torch.allclose(actual, reference_mlp(layer, x, "swiglu"), atol=1e-5)
        # The opposite order (gate then up) would give something else, so the check can fail.
        swapped = torch.cat(layer.mlp.linear1.weight.chunk(2)[::-1])
        layer.mlp.linear1.weight.copy_(swapped)
        assert not torch.allclose(layer.mlp(x), actual, atol=1e-3)


def test_grouped_query_attention_equals_full_attention_with_repeated_key_value_heads():
    """A GQA model (2 kv heads) and a full-attention model whose k/v heads repeat each group's: same logits."""
    gqa = build_model(tiny_args(LLAMA, num_kv_heads=2).architecture(), 1234).eval()
    randomize_(gqa)
    full = build_model(tiny_args(LLAMA, num_kv_heads=HEADS).architecture(), 1234).eval()
    state = gqa.state_dict()
    d, group = HEAD_DIM, HEADS // 2
    for i in range(2):
        key = f"sequential.{i + 2}.attention.query_key_value.weight"
        q, k, v = state[key].split([HEADS * d, 2 * d, 2 * d])
        k_full = k.view(2, d, HIDDEN).repeat_interleave(group, dim=0)
        v_full = v.view(2, d, HIDDEN).repeat_interleave(group, dim=0)
        state[key] = torch.stack([q.view(HEADS, d, HIDDEN), k_full, v_full], dim=1).reshape(
            3 * HIDDEN, HIDDEN
        )
    full.load_state_dict(state)
    with torch.no_grad():
        assert torch.allclose(gqa(tokens()), full(tokens()), atol=1e-5)


def test_grouped_layout_with_as_many_kv_heads_as_heads_equals_the_per_head_layout():
    model = build_model(tiny_args(NEOX).architecture(), 1234).eval()
    randomize_(model)
    with torch.no_grad():
        expected = model(tokens())
        for layer in model.layers:
            attention = layer.attention
            assert not attention.grouped_layout
            for p in (attention.query_key_value.weight, attention.query_key_value.bias):
                per_head = p.view(HEADS, 3, HEAD_DIM, *p.shape[1:])
                p.copy_(per_head.transpose(0, 1).reshape(p.shape))  # -> all q, all k, all v
            attention.grouped_layout = True
        assert torch.allclose(model(tokens()), expected, atol=1e-5)


# ---------------------------------------------------------------- residual modes


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_layer_output_matches_hand_computation_from_its_weights(parallel):
    args = tiny_args(NEOX, pos_emb="none", gpt_j_residual=parallel)
    layer = build_model(args.architecture(), 0).layers[0]
    randomize_(layer)
    x = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(8))

    def ln(t, norm):
        return F.layer_norm(t, (HIDDEN,), norm.weight, norm.bias, 1e-5)

    def attn(t):
        q, k, v = reference_qkv(layer, t[0], HEADS, HEADS)
        out = F.linear(
            reference_attention(q, k, v).float(), layer.attention.dense.weight, layer.attention.dense.bias
        )
        return out.unsqueeze(0)

    with torch.no_grad():
        a = attn(ln(x, layer.input_layernorm))
        if parallel:
            expected = x + a + reference_mlp(layer, ln(x, layer.post_attention_layernorm), "gelu")
        else:
            h = x + a
            expected = h + reference_mlp(layer, ln(h, layer.post_attention_layernorm), "gelu")
        actual = layer(x, None)
        assert torch.allclose(actual, expected, atol=1e-4)
        layer.parallel_residual = not parallel
        assert not torch.allclose(layer(x, None), expected, atol=1e-2)


def test_rmsnorm_layer_matches_hand_computation():
    layer = build_model(tiny_args(LLAMA, pos_emb="none").architecture(), 0).layers[0]
    randomize_(layer)
    x = torch.randn(1, 4, HIDDEN, generator=torch.Generator().manual_seed(9))

    def rms(t, norm):
        return norm.scale * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)

    with torch.no_grad():
        q, k, v = reference_qkv(layer, rms(x, layer.input_layernorm)[0], HEADS, 2)
        h = x + F.linear(reference_attention(q, k, v).float(), layer.attention.dense.weight).unsqueeze(0)
        expected = h + reference_mlp(layer, rms(h, layer.post_attention_layernorm), "swiglu")
        assert torch.allclose(layer(x, None), expected, atol=1e-4)


# ---------------------------------------------------------------- training behaviour


def test_loss_falls_on_a_repeated_batch():
    model = build_model(tiny_args(LLAMA).architecture(), 1234)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = tokens(seed=11)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(8):
        loss = causal_lm_loss(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.1)
    assert losses[-1] < 0.6 * losses[0]


@pytest.mark.parametrize("family", [NEOX, LLAMA], ids=["neox", "llama"])
def test_activation_checkpointing_gives_the_same_gradients(family):
    def grads(checkpoint: bool) -> dict[str, torch.Tensor]:
        model = build_model(tiny_args(family, checkpoint_activations=checkpoint, hidden_dropout=0.1, attention_dropout=0.1).architecture(), 1234)
        model.train()
        torch.manual_seed(99)  # same dropout masks in both runs
        batch = tokens(seed=12)
        causal_lm_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, recomputed = grads(False), grads(True)
    assert plain.keys() == recomputed.keys()
    for name in plain:
        assert torch.allclose(plain[name], recomputed[name], atol=1e-6), name


def test_dropout_is_active_in_training_and_off_in_eval():
    model = build_model(tiny_args(NEOX, hidden_dropout=0.3, attention_dropout=0.3).architecture(), 1234)
    batch = tokens()
    with torch.no_grad():
        model.train()
        assert not torch.allclose(model(batch), model(batch))
        model.eval()
        assert torch.equal(model(batch), model(batch))


def test_causal_lm_loss_is_mean_token_cross_entropy_over_the_mask():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    labels = torch.tensor([[0, 1, 2], [3, 4, 0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = [-log_probs[b, s, labels[b, s]] for b in range(2) for s in range(3)]
    assert causal_lm_loss(logits, labels).dtype == torch.float32
    assert causal_lm_loss(logits, labels).item() == pytest.approx(sum(picked).item() / 6, rel=1e-5)
    masked = (picked[0] + picked[2] + picked[5]) / 3
    assert causal_lm_loss(logits, labels, mask).item() == pytest.approx(masked.item(), rel=1e-5)


# ---------------------------------------------------------------- init, seeding, helpers


@pytest.mark.parametrize(
    "method,expected_std",
    [
        ("normal", 0.02),
        ("scaled_normal", 0.02 / math.sqrt(2 * 4)),
        ("small_init", math.sqrt(2 / (5 * 128))),
        ("wang_init", 2 / (4 * math.sqrt(128))),
    ],
)
def test_init_methods_draw_with_gpt_neox_standard_deviations(method, expected_std):
    args = tiny_args(
        NEOX,
        num_layers=4,
        hidden_size=128,
        init_method=method,
        output_layer_init_method=method,
        intermediate_size=512,
    )
    model = build_model(args.architecture(), args.seed)
    params = dict(model.named_parameters())
    for name in (
        "sequential.0.word_embeddings.weight",
        "sequential.2.attention.query_key_value.weight",
        "sequential.2.attention.dense.weight",
        "sequential.3.mlp.linear1.weight",
        "sequential.5.mlp.linear2.weight",
        "sequential.8.final_linear.weight",
    ):
        assert params[name].std().item() == pytest.approx(expected_std, rel=0.1), name
    assert torch.equal(params["sequential.2.attention.dense.bias"], torch.zeros(128))
    assert torch.equal(params["sequential.7.norm.weight"], torch.ones(128))


def test_output_layer_init_method_applies_to_attention_dense_and_mlp_linear2_only():
    args = tiny_args(NEOX, num_layers=8, init_method="normal", output_layer_init_method="scaled_normal")
    params = dict(build_model(args.architecture(), args.seed).named_parameters())
    scaled = 0.02 / math.sqrt(16)
    for name in ("attention.dense", "mlp.linear2"):
        assert params[f"sequential.2.{name}.weight"].std().item() == pytest.approx(scaled, rel=0.15)
    for name in ("attention.query_key_value", "mlp.linear1"):
        assert params[f"sequential.2.{name}.weight"].std().item() == pytest.approx(0.02, rel=0.15)


def test_build_model_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    a = build_model(tiny_args(LLAMA, seed=1).architecture(), 1)
    assert torch.equal(torch.rand(1), before)
    b = build_model(tiny_args(LLAMA, seed=1).architecture(), 1)
    c = build_model(tiny_args(LLAMA, seed=2).architecture(), 2)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and "norm" not in name:
            assert not torch.equal(pa, pc), name


@pytest.mark.parametrize("family", [NEOX, LLAMA], ids=["neox", "llama"])
def test_no_weight_decay_names_are_the_biases_and_norm_weights(family):
    model = build_model(tiny_args(family).architecture(), 0)
    expected = {
        name
        for name, _ in model.named_parameters()
        if name.endswith(".bias") or "layernorm" in name or ".norm." in name
    }
    assert no_weight_decay_param_names(model) == expected
    assert all("word_embeddings" not in n and "final_linear" not in n for n in expected)


def test_translate_legacy_key_renames_the_old_mlp_names_only():
    assert translate_legacy_key("sequential.2.mlp.dense_h_to_4h.weight") == "sequential.2.mlp.linear1.weight"
    assert translate_legacy_key("sequential.9.mlp.dense_4h_to_h.bias") == "sequential.9.mlp.linear2.bias"
    assert (
        translate_legacy_key("sequential.2.attention.dense.weight") == "sequential.2.attention.dense.weight"
    )


def test_gpt_neox_rotary_frequency_buffers_are_recognised_and_not_stored():
    assert is_legacy_buffer_key("sequential.4.attention.rotary_emb.inv_freq")
    assert not is_legacy_buffer_key("sequential.4.attention.dense.weight")
    assert not any(is_legacy_buffer_key(name) for name in build_model(tiny_args(NEOX).architecture(), 0).state_dict())


def test_unset_sizes_get_gpt_neox_defaults():
    def sizes(**kw):
        arch = tiny_args(**kw).architecture()
        return arch.num_kv_heads, arch.intermediate_size, arch.max_position_embeddings

    assert sizes() == (HEADS, 4 * HIDDEN, SEQ)
    # swiglu: int(4 * 64 * 2 / 3) = 170 for gate + up, 85 each
    assert sizes(activation="swiglu")[1] == 85
    # rounded up: linear1 to a multiple of 2 x 32 (192), linear2's input to one of 32 (96)
    assert sizes(activation="swiglu", mlp_multiple_of=32)[1] == 96
    assert sizes(intermediate_size=100, num_kv_heads=2, max_position_embeddings=50) == (2, 100, 50)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(padded_vocab_size=None), "padded_vocab_size"),
        (dict(num_kv_heads=3), "num_kv_heads=3 must divide"),
        (dict(hidden_size=66), "not divisible by num_attention_heads"),
        (dict(pos_emb="rotary", rotary_pct=0.1), "rotary"),
        (dict(norm="scalenorm"), "norm='scalenorm'"),
    ],
)
def test_impossible_settings_are_refused_with_the_setting_named(overrides, message):
    # past the settings layer's own checks (validated settings never hold these): the model checks too
    settings = {**tiny_args().to_dict(), **overrides}
    with pytest.raises(ModelConfigError, match=message):
        GPTModel(architecture_from_settings(settings))


def test_swiglu_gradients_equal_autograd_through_chunk():
    x = torch.randn(3, 5, 2 * 24, generator=torch.Generator().manual_seed(11), requires_grad=True)
    weight = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(12))
    (ours,) = torch.autograd.grad((swiglu(x) * weight).sum(), x)
    up, gate = x.chunk(2, dim=-1)
    (reference,) = torch.autograd.grad((F.silu(gate) * up * weight).sum(), x)
    assert torch.equal(swiglu(x), F.silu(gate) * up)
    assert torch.allclose(ours, reference, atol=1e-6)


def test_sliding_window_mask_is_the_causal_band_of_the_given_width():
    # width 2 over 5 positions: each query sees itself and the 2 keys before it (flash-attn's window_size=(2, -1))
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(sliding_window_mask(5, 2), expected)


def _windowed_reference(q, k, v, allowed):
    """reference_attention with the keys each query may see given by a hand-written mask."""
    s, heads, d = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(s, heads, d, dtype=torch.float64)
    for h in range(heads):
        for i in range(s):
            keys = [j for j in range(s) if allowed[i][j]]
            scores = torch.stack([q[i, h].double() @ k[j, h // group].double() for j in keys]) / math.sqrt(d)
            probs = torch.softmax(scores, dim=0)
            out[i, h] = sum(p * v[j, h // group].double() for p, j in zip(probs, keys, strict=True))
    return out.reshape(s, heads * d)


@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa"])
def test_sliding_window_attention_sees_only_the_window(kv_heads):
    allowed = [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0],
               [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]  # width 1
    layer = build_model(tiny_args(NEOX, pos_emb="none", num_kv_heads=kv_heads, sliding_window_width=1).architecture(), 0).layers[0]
    randomize_(layer)
    x = torch.randn(1, 6, HIDDEN, generator=torch.Generator().manual_seed(3))
    q, k, v = reference_qkv(layer, x[0], HEADS, kv_heads)
    expected = F.linear(_windowed_reference(q, k, v, allowed).float(), layer.attention.dense.weight,
                        layer.attention.dense.bias)
    full_causal = F.linear(reference_attention(q, k, v).float(), layer.attention.dense.weight,
                           layer.attention.dense.bias)
    with torch.no_grad():
        actual = layer.attention(x, None)[0]
    assert torch.allclose(actual, expected, atol=1e-5)
    assert not torch.allclose(actual[2:], full_causal[2:], atol=1e-3)  # the window changed the later rows


def test_sliding_window_at_least_the_sequence_is_plain_causal_attention():
    args = tiny_args(NEOX, pos_emb="none")
    plain, windowed = build_model(args.architecture(), 0).layers[0], build_model(tiny_args(NEOX, pos_emb="none", sliding_window_width=5).architecture(), 0).layers[0]
    windowed.load_state_dict(plain.state_dict())
    x = torch.randn(1, 6, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(plain.attention(x, None), windowed.attention(x, None))
