"""Module-only loads through real DeepSpeed engines: every precision and ZeRO stage, one rank on CPU."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from deepspeed.runtime import constants as deepspeed_constants

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.loading import master_weights as master_weights_module
from megatron.checkpointing.loading import module_load as module_load_module
from megatron.checkpointing.loading.module_load import load_module_only
from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.checkpointing.saving.engine_save import save_engine_checkpoint
from tests.ckpt_engines import (
    DTYPES,
    batch,
    bits_equal,
    build_engine,
    ds_config,
    eval_loss,
    master_weights,
    refresh_that_only_checks,
    set_lr,
    stored_client_state,
    train_step,
    training_weights,
)

pytestmark = pytest.mark.usefixtures("single_rank_world", "fp16_capable_cpu")


# Optimizer classes stock DeepSpeed builds without ZeRO. bf16: FP16_Optimizer in 0.17.6 and later
# (bf16 gradients), BF16_Optimizer up to 0.17.0 (fp32 gradients by default).
_NO_ZERO_OPTIMIZERS = {
    "fp32": ("FusedAdam",),
    "fp16": ("FP16_Optimizer",),
    "bf16": ("FP16_Optimizer", "BF16_Optimizer"),
}
_ZERO_OPTIMIZERS = {
    1: ("DeepSpeedZeroOptimizer",),
    2: ("DeepSpeedZeroOptimizer",),
    3: ("DeepSpeedZeroOptimizer_Stage3",),
}
# bf16 ZeRO-1 with fp32 gradients is BF16_Optimizer, except where DeepSpeed names its "DDP bf16" wrapper
# like the BF16_Optimizer one ("bf16", e.g. 0.17.6) and so builds FP16_Optimizer, without ZeRO, instead.
_BF16_FP32_GRADS_ZERO1_OPTIMIZERS = (
    ("FP16_Optimizer",)
    if getattr(deepspeed_constants, "DDP_BFLOAT16", None) == deepspeed_constants.BFLOAT16
    else ("BF16_Optimizer",)
)

# (precision, stage, extra config, the optimizer classes DeepSpeed may build for it)
MATRIX = [
    (precision, stage, {}, _ZERO_OPTIMIZERS[stage] if stage else _NO_ZERO_OPTIMIZERS[precision])
    for precision in DTYPES
    for stage in (0, 1, 2, 3)
] + [
    ("bf16", 1, {"data_types": {"grad_accum_dtype": "fp32"}}, _BF16_FP32_GRADS_ZERO1_OPTIMIZERS),
    ("fp16", 0, {"optimizer_params": {"torch_adam": True}}, ("FP16_UnfusedOptimizer",)),
    ("bf16", 3, {"zero": {"stage3_param_persistence_threshold": 0}}, _ZERO_OPTIMIZERS[3]),
]


def _ids(case):
    precision, stage, extra, _ = case
    return f"{precision}-zero{stage}" + ("-" + "-".join(extra) if extra else "")


def _config(precision, stage, extra):
    return ds_config(precision, stage, **copy.deepcopy(extra))


def _save_trained(tmp_path, config, tag="global_step1", seed=1):
    """Engine A trained one step and saved; returns (engine, tag_dir, checkpoint values in fp32)."""
    engine = build_engine(config, seed=seed)
    train_step(engine, batch(0))
    # Client state like the trainer's: numpy's RNG state is what the weights-only unpickler refuses.
    client_state = {"iteration": 1, "numpy_rng": np.random.get_state()}
    assert save_engine_checkpoint(engine, tmp_path, tag, client_state) is None
    tag_dir = tmp_path / tag
    return engine, tag_dir, _checkpoint_values(engine)


def _checkpoint_values(engine):
    """What the saved module file must hold: the fp32 master under ZeRO-3, else the training-dtype weights."""
    if engine.zero_optimization_stage() == 3:
        return master_weights(engine)
    return {name: value.float() for name, value in training_weights(engine).items()}


def _assert_engine_holds(engine, expected_fp32):
    dtype = next(engine.module.parameters()).dtype
    weights, masters = training_weights(engine), master_weights(engine)
    for name, value in expected_fp32.items():
        if name not in weights:
            continue
        assert bits_equal(weights[name], value.to(dtype)), (
            f"training weights of {name} differ from the checkpoint"
        )
        assert bits_equal(masters[name], value), f"fp32 master of {name} differs from the checkpoint"


@pytest.mark.parametrize("precision,stage,extra,optimizer_classes", MATRIX, ids=[_ids(c) for c in MATRIX])
@pytest.mark.slow
def test_module_only_load_survives_a_step(tmp_path, precision, stage, extra, optimizer_classes):
    config = _config(precision, stage, extra)
    engine_a, tag_dir, saved = _save_trained(tmp_path, config)
    fixed = batch(7)
    loss_a = eval_loss(engine_a, fixed)
    # A module-only load never opens optimizer files: delete them.
    for optimizer_file in tag_dir.glob("*optim_states.pt"):
        optimizer_file.unlink()

    engine_b = build_engine(config, seed=2)
    assert type(engine_b.optimizer).__name__ in optimizer_classes
    before = training_weights(engine_b)
    assert not all(torch.equal(before[n], saved[n].to(before[n].dtype)) for n in before), (
        "B must start elsewhere"
    )

    report = load_module_only(engine_b, read_module_weights(tag_dir))
    assert not report.missing and not report.unexpected and not report.mismatched
    assert torch.equal(eval_loss(engine_b, fixed), loss_a), (
        "the first forward after the load must see the weights"
    )
    set_lr(engine_b, 0.0)
    train_step(engine_b, batch(0))

    _assert_engine_holds(engine_b, saved)
    assert torch.equal(eval_loss(engine_b, fixed), loss_a)


@pytest.mark.parametrize(
    "precision,stage,extra",
    [
        ("bf16", 1, {}),
        ("bf16", 2, {}),
        ("fp16", 0, {}),
        ("bf16", 3, {}),
        ("bf16", 1, {"data_types": {"grad_accum_dtype": "fp32"}}),
    ],
    ids=["bf16-zero1", "bf16-zero2", "fp16-zero0", "bf16-zero3", "bf16-zero1-BF16_Optimizer"],
)
def test_verification_fails_without_master_refresh(tmp_path, monkeypatch, precision, stage, extra):
    config = _config(precision, stage, extra)
    _, tag_dir, _ = _save_trained(tmp_path, config)
    engine_b = build_engine(config, seed=2)
    monkeypatch.setattr(master_weights_module, "refresh_master_weights", refresh_that_only_checks)
    with pytest.raises(CheckpointError, match="master weights differ"):
        load_module_only(engine_b, read_module_weights(tag_dir))


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16],
                         ids=["wider-than-the-model", "the-model-s-dtype"])  # cast back / compared as it is
@pytest.mark.parametrize("write_elsewhere", [False, True], ids=["no-writer", "a-writer-copying-elsewhere"])
def test_refresh_from_values_other_than_the_module_s_is_refused_in_the_same_pass(tmp_path, source_dtype,
                                                                                 write_elsewhere):
    """The refresh checks what it wrote: a master written from values the parameters do not hold fails. The
    address proof holds only for the memory the optimizer maps: a writer whose copy lands elsewhere (a copy
    of the parameter) leaves the parameter as it was, and the comparison finds it."""
    config = ds_config("bf16", 1)
    _, tag_dir, _ = _save_trained(tmp_path, config)
    engine = build_engine(config, seed=2)
    weights = read_module_weights(tag_dir)
    load_module_only(engine, weights)
    name = "head.weight"
    other = {name: (weights[name].float() + 1.0).to(source_dtype)}
    parameter = dict(engine.module.named_parameters())[name]
    writer = (lambda written: parameter.detach().clone().copy_(other[written])) if write_elsewhere else None
    with pytest.raises(CheckpointError, match=rf"master weights differ .* first in '{name}'"):
        master_weights_module.refresh_master_weights(engine, other, writer)
    master_weights_module.refresh_master_weights(engine, {name: weights[name]})  # the right values pass again


@pytest.mark.parametrize("precision,stage", [("bf16", 1), ("fp16", 0), ("bf16", 3)])
def test_a_parameter_copied_in_place_is_proven_by_its_address_and_its_master_still_written(
        tmp_path, monkeypatch, precision, stage):
    """A loader's same-dtype copy into the parameter the optimizer maps needs no comparison (ZeRO-3
    partitions, written through DeepSpeed, are still compared); the masters hold the checkpoint either way."""
    config = ds_config(precision, stage)
    _, tag_dir, saved = _save_trained(tmp_path, config)
    engine = build_engine(config, seed=2)
    compared = []
    same_bits = master_weights_module._same_bits
    monkeypatch.setattr(master_weights_module, "_same_bits", lambda a, b: compared.append(a.numel()) or same_bits(a, b))
    load_module_only(engine, read_module_weights(tag_dir))
    assert bool(compared) == (stage == 3)
    for name, master in master_weights(engine).items():
        assert torch.equal(master, saved[name].float()), name  # ZeRO-3 saves its fp32 master, the others their parameters
    master_weights_module.verify_master_weights(engine)


def test_masters_that_share_memory_are_refused_since_a_later_write_would_change_checked_values():
    trained = torch.zeros(8, dtype=torch.bfloat16)
    master = torch.zeros(8)
    fragment = master_weights_module.MasterFragment
    apart = [fragment("a", 0, master[:4], trained[:4]), fragment("b", 0, master[4:], trained[4:])]
    master_weights_module._refuse_overlapping_masters(apart)
    zero3_twice = [fragment("a", 0, master[:4], trained[:4]), fragment("a", 0, master[:4], torch.zeros(4).bfloat16())]
    master_weights_module._refuse_overlapping_masters(zero3_twice)  # one master, one parameter's two copies
    for clashing in ([apart[0], fragment("b", 0, master[2:6], trained[4:])],
                     [apart[0], fragment("b", 0, trained[:8].view(torch.float32), trained[4:])]):
        with pytest.raises(CheckpointError, match="shares memory"):
            master_weights_module._refuse_overlapping_masters(clashing)


def test_verification_finds_one_changed_element_anywhere(tmp_path):
    """One flipped bit at either end of any fragment, where the word-wise comparison has its unaligned edges."""
    config = ds_config("bf16", 1)
    _, tag_dir, _ = _save_trained(tmp_path, config)
    engine = build_engine(config, seed=2)
    load_module_only(engine, read_module_weights(tag_dir))
    fragments = list(master_weights_module.master_fragments(engine))
    assert any(fragment.trained.storage_offset() % 4 for fragment in fragments), "some must start mid-word"
    for fragment in fragments:
        bits = fragment.trained.view(torch.int16)
        for position in {0, bits.numel() - 1}:
            bits[position] ^= 1
            with pytest.raises(CheckpointError, match=rf"'{fragment.name}' \(1 of {bits.numel()} local elements\)"):
                master_weights_module.verify_master_weights(engine)
            bits[position] ^= 1
    master_weights_module.verify_master_weights(engine)


def test_verification_of_a_fragment_shorter_than_a_word_that_starts_mid_word():
    """A one-element 16-bit fragment two bytes into a word (two ranks split a parameter so on DeepSpeed
    0.16.9): no whole word to compare, and the bytes after it end mid-word."""
    storage = torch.arange(8, dtype=torch.bfloat16)
    for trained, differing in ((storage[1:2], 0), (storage[5:6], 1)):
        fragment = master_weights_module.MasterFragment("p", 0, torch.tensor([1.0]), trained)
        assert master_weights_module._count_differing(fragment, {}) == differing


def test_stale_master_really_undoes_the_load(tmp_path, monkeypatch):
    """The failure the guard exists for: without refresh and check, one lr-0 step restores the random init."""
    config = ds_config("bf16", 2)
    _, tag_dir, saved = _save_trained(tmp_path, config)
    engine_b = build_engine(config, seed=2)
    init = training_weights(engine_b)
    monkeypatch.setattr(master_weights_module, "refresh_master_weights", refresh_that_only_checks)  # no master
    monkeypatch.setattr(master_weights_module, "verify_master_weights", lambda engine: None)
    load_module_only(engine_b, read_module_weights(tag_dir))
    assert bits_equal(training_weights(engine_b)["head.weight"], saved["head.weight"].bfloat16())
    set_lr(engine_b, 0.0)
    train_step(engine_b, batch(0))
    assert bits_equal(training_weights(engine_b)["head.weight"], init["head.weight"])


@pytest.mark.parametrize("stage", [1, 3])
def test_a_module_only_load_writes_every_tensor_in_the_checkpoint_s_order_all_before_the_ranks_vote(
        tmp_path, monkeypatch, stage):
    """In a memory-mapped file's order, so that when a cold file's last pages come in only its last tensors
    are left to copy; none after the vote, where a rank that waited for the others would copy the parameters
    whose master another rank holds (under ZeRO-1 on 2 ranks, half of them) while every rank waits for it."""
    config = ds_config("bf16", stage)
    _, tag_dir, saved = _save_trained(tmp_path, config)
    engine = build_engine(config, seed=2)
    weights = dict(reversed(read_module_weights(tag_dir).items()))  # not the model's order
    names = {id(value): name for name, value in weights.items()}
    events = []
    write, vote = module_load_module._write, master_weights_module.reported_by_ranks
    monkeypatch.setattr(module_load_module, "_write",
                        lambda target, value: events.append(names[id(value)]) or write(target, value))
    monkeypatch.setattr(master_weights_module, "reported_by_ranks", lambda value: events.append("vote") or vote(value))
    load_module_only(engine, weights)
    assert events == [*weights, "vote"]
    _assert_engine_holds(engine, saved)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_fp32_checkpoint_keeps_full_precision_in_bf16_master(tmp_path, stage):
    _, tag_dir, saved = _save_trained(tmp_path, ds_config("fp32", 0))
    engine_b = build_engine(ds_config("bf16", stage), seed=2)
    load_module_only(engine_b, read_module_weights(tag_dir))
    masters = master_weights(engine_b)
    for name, value in saved.items():
        assert bits_equal(masters[name], value), name
    rounded = saved["head.weight"].bfloat16().float()
    assert not torch.equal(rounded, saved["head.weight"]), "the checkpoint must have bits bf16 cannot hold"
    set_lr(engine_b, 0.0)
    train_step(engine_b, batch(0))
    _assert_engine_holds(engine_b, saved)


def test_zero3_reads_the_requested_tag_not_latest(tmp_path):
    config = ds_config("bf16", 3)
    engine_a = build_engine(config, seed=1)
    train_step(engine_a, batch(0))
    assert save_engine_checkpoint(engine_a, tmp_path, "global_step1", {"iteration": 1}) is None
    old_dir = tmp_path / "global_step1"
    old = master_weights(engine_a)
    train_step(engine_a, batch(1))
    save_engine_checkpoint(engine_a, tmp_path, "global_step2", {"iteration": 2})
    layout.write_latest(tmp_path, "global_step2")  # `latest` names the newer tag; step 1 is asked for
    assert not torch.equal(master_weights(engine_a)["head.weight"], old["head.weight"])

    engine_b = build_engine(config, seed=2)
    load_module_only(engine_b, read_module_weights(old_dir))
    _assert_engine_holds(engine_b, old)
    assert stored_client_state(old_dir)["iteration"] == 1


def test_zero3_load_after_a_step_reaches_whole_persistent_params(tmp_path):
    """After a step ZeRO-3 keeps small ("persistent") parameters whole next to their partitions; the
    load must write both or the next forward runs on the old values (on 2 ranks, where the whole copy
    is separate storage, the worker of test_ckpt_engine_distributed.py checks the same)."""
    config = ds_config("bf16", 3)
    engine_a, tag_dir, saved = _save_trained(tmp_path, config)
    fixed = batch(7)
    loss_a = eval_loss(engine_a, fixed)
    engine_b = build_engine(config, seed=2)
    train_step(engine_b, batch(3))
    head = engine_b.module.head.weight
    assert head.ds_persist and head.ds_status.name == "AVAILABLE"
    load_module_only(engine_b, read_module_weights(tag_dir))
    assert torch.equal(eval_loss(engine_b, fixed), loss_a)
    _assert_engine_holds(engine_b, saved)


@pytest.mark.parametrize(
    "stage,shards_only", [(1, False), (3, False), (3, True)], ids=["zero1", "zero3", "zero3-shards"]
)
def test_frozen_parameters_load_without_a_master(tmp_path, stage, shards_only):
    config = ds_config("bf16", stage)
    frozen = ("final_norm.weight", "blocks.0.up.bias")
    engine_a = build_engine(config, seed=1, frozen=frozen)
    train_step(engine_a, batch(0))
    assert save_engine_checkpoint(engine_a, tmp_path, "global_step1", {"iteration": 1}) is None
    tag_dir = tmp_path / "global_step1"
    trained = training_weights(engine_a)
    if shards_only:
        (tag_dir / "mp_rank_00_model_states.pt").unlink()
    weights = read_module_weights(tag_dir)
    for name in frozen:
        assert bits_equal(weights[name].bfloat16(), trained[name]), name
    engine_b = build_engine(config, seed=2, frozen=frozen)
    load_module_only(engine_b, weights)
    set_lr(engine_b, 0.0)
    train_step(engine_b, batch(0))
    after = training_weights(engine_b)
    assert all(bits_equal(after[name], trained[name]) for name in trained)


def test_zero3_tag_without_module_file_or_shards_is_an_error(tmp_path):
    _, tag_dir, _ = _save_trained(tmp_path, ds_config("bf16", 3))
    (tag_dir / "mp_rank_00_model_states.pt").unlink()
    for optimizer_file in tag_dir.glob("*optim_states.pt"):
        optimizer_file.unlink()
    with pytest.raises(
        CheckpointError, match="no module weights in .*zero_pp_rank_0_mp_rank_00_model_states.pt"
    ):
        read_module_weights(tag_dir)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero3_shards_alone_give_the_master_weights(tmp_path, precision):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _, tag_dir, saved = _save_trained(tmp_path, ds_config(precision, 3))
    (tag_dir / "mp_rank_00_model_states.pt").unlink()
    rebuilt = read_module_weights(tag_dir)
    reference = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag=tag_dir.name)
    assert set(rebuilt) == set(reference) == set(saved) | {"logit_scale"}
    for name, value in saved.items():
        assert bits_equal(rebuilt[name], value), name
        assert bits_equal(reference[name], value), name
    assert torch.equal(rebuilt["logit_scale"], torch.tensor([0.5]))


def test_module_file_of_placeholders_falls_back_to_zero3_shards(tmp_path):
    _, tag_dir, saved = _save_trained(tmp_path, ds_config("bf16", 3))
    module_file = tag_dir / "mp_rank_00_model_states.pt"
    torch.save({"module": {name: torch.empty(0) for name in saved}, "iteration": 1}, module_file)
    rebuilt = read_module_weights(tag_dir)
    assert all(bits_equal(rebuilt[name], value) for name, value in saved.items())


def test_zero3_extra_module_file_keeps_deepspeed_resume_and_tools_working(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    config = ds_config("bf16", 3)
    engine_a, tag_dir, saved = _save_trained(tmp_path, config)
    assert (tag_dir / "mp_rank_00_model_states.pt").is_file()
    engine_c = build_engine(config, seed=3)
    load_path, client_state = engine_c.load_checkpoint(str(tmp_path), tag=tag_dir.name)
    assert load_path is not None and client_state["iteration"] == 1
    _assert_engine_holds(engine_c, saved)
    reference = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag=tag_dir.name)
    assert all(bits_equal(reference[name], value) for name, value in saved.items())


def test_module_file_keys_are_the_state_dict_names(tmp_path):
    engine_a, tag_dir, _ = _save_trained(tmp_path, ds_config("bf16", 3))
    weights = read_module_weights(tag_dir)
    assert list(weights) == list(engine_a.module.state_dict())
    # Parameters hold their fp32 master; buffers the engine's dtype (0.14-0.15 cast them to bf16).
    assert all(weights[name].dtype == torch.float32 for name, _ in engine_a.module.named_parameters())
    client = stored_client_state(tag_dir)
    assert "module" not in client and client["iteration"] == 1 and client["ds_version"]
    assert client["numpy_rng"][0] == "MT19937" and isinstance(client["numpy_rng"][1], np.ndarray)


def test_client_state_of_a_deepspeed_only_zero3_tag(tmp_path):
    _, tag_dir, _ = _save_trained(tmp_path, ds_config("bf16", 3))
    (tag_dir / "mp_rank_00_model_states.pt").unlink()
    client = stored_client_state(tag_dir)
    assert client["iteration"] == 1 and "param_shapes" in client


def test_pipeline_layer_files_are_read(tmp_path):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 11))
    wrapper = torch.nn.Module()
    wrapper.sequential = layers
    full = wrapper.state_dict()
    tag_dir = tmp_path / "global_step3"
    tag_dir.mkdir()
    for index in range(len(layers)):
        prefix = f"sequential.{index}."
        layer_state = {key[len(prefix) :]: value for key, value in full.items() if key.startswith(prefix)}
        torch.save(layer_state, tag_dir / f"layer_{index:02d}-model_00-model_states.pt")
    # GPT-NeoX keeps client state in an mp_rank file whose module is None.
    torch.save({"module": None, "iteration": 3}, tag_dir / "mp_rank_00_model_states.pt")
    read = read_module_weights(tag_dir)
    assert list(read) == list(full)
    assert all(torch.equal(read[key], full[key]) for key in full)
    assert stored_client_state(tag_dir)["iteration"] == 3


def test_truncated_file_is_named(tmp_path):
    _, tag_dir, _ = _save_trained(tmp_path, ds_config("bf16", 1))
    module_file = tag_dir / "mp_rank_00_model_states.pt"
    data = module_file.read_bytes()
    module_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt.*truncated or corrupt"):
        read_module_weights(tag_dir)


def test_empty_tag_lists_what_it_holds(tmp_path):
    (tmp_path / "global_step5").mkdir()
    (tmp_path / "global_step5" / "notes.txt").write_text("x")
    with pytest.raises(
        CheckpointError, match=r"no module weights .*expected mp_rank_00_model_states\.pt.*notes\.txt"
    ):
        read_module_weights(tmp_path / "global_step5")


def test_strict_load_names_the_mismatch(tmp_path):
    _, tag_dir, _ = _save_trained(tmp_path, ds_config("bf16", 2))
    weights = read_module_weights(tag_dir)
    engine_b = build_engine(ds_config("bf16", 2), seed=2)
    missing = {k: v for k, v in weights.items() if k != "blocks.1.up.bias"}
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['blocks.1.up.bias'\]"):
        load_module_only(engine_b, missing)
    extra = {**weights, "blocks.2.up.weight": torch.zeros(3)}
    with pytest.raises(CheckpointError, match=r"the model does not have: \['blocks.2.up.weight'\]"):
        load_module_only(engine_b, extra)
    reshaped = {**weights, "head.weight": torch.zeros(5, 24)}
    with pytest.raises(CheckpointError, match=r"head.weight: checkpoint \(5, 24\) vs model \(37, 24\)"):
        load_module_only(engine_b, reshaped)


@pytest.mark.parametrize("stage", [1, 3])
def test_non_strict_load_reports_and_loads_the_rest(tmp_path, stage):
    config = ds_config("bf16", stage)
    _, tag_dir, saved = _save_trained(tmp_path, config)
    weights = read_module_weights(tag_dir)
    weights.pop("blocks.1.up.bias")
    weights["head.weight"] = torch.zeros(5, 24)
    weights["extra.weight"] = torch.zeros(2)
    engine_b = build_engine(config, seed=2)
    untouched = training_weights(engine_b)
    report = load_module_only(engine_b, weights, strict=False, allow_random=["head.*"])  # a whole layer
    assert report.missing == ["blocks.1.up.bias"]
    assert report.unexpected == ["extra.weight"]
    assert report.mismatched == [("head.weight", (5, 24), (37, 24))]
    loaded = {n: v for n, v in saved.items() if n not in ("blocks.1.up.bias", "head.weight")}
    _assert_engine_holds(engine_b, loaded)
    after = training_weights(engine_b)
    assert bits_equal(after["head.weight"], untouched["head.weight"])
    assert bits_equal(after["blocks.1.up.bias"], untouched["blocks.1.up.bias"])


def test_unknown_optimizer_layout_is_an_error(tmp_path):
    _, tag_dir, _ = _save_trained(tmp_path, ds_config("fp32", 0))
    engine_b = build_engine(ds_config("fp32", 0), seed=2)
    # An optimizer stepping tensors that are not the module's: its master copy is out of reach.
    engine_b.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(CheckpointError, match="unknown optimizer torch.optim.sgd.SGD"):
        load_module_only(engine_b, read_module_weights(tag_dir))
