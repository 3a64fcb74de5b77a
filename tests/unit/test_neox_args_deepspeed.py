"""The DeepSpeed config built from the settings, checked by DeepSpeed itself: ZeRO 0-3 x fp32/fp16/bf16."""

from __future__ import annotations

import pytest
import torch

from megatron.neox_arguments import ConfigError, NeoXArgs
from tests.unit.test_neox_args import TINY_RUN

PRECISIONS = {
    "fp32": {},
    "fp16": {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}},
    "bf16": {"bf16": {"enabled": True}},
}


def settings(stage: int, precision: str, **extra) -> NeoXArgs:
    values = {
        **TINY_RUN,
        **PRECISIONS[precision],
        "zero_optimization": {"stage": stage},
        "gradient_accumulation_steps": 3,
        "weight_decay": 0.05,
        "gradient_clipping": 0.7,
        **extra,
    }
    return NeoXArgs.from_dict(values, source="test", require_run_settings=True)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_config_contents(stage, precision):
    config = settings(stage, precision).deepspeed_config()
    assert config["zero_optimization"]["stage"] == stage
    assert config["train_micro_batch_size_per_gpu"] == TINY_RUN["train_micro_batch_size_per_gpu"]
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == TINY_RUN["train_micro_batch_size_per_gpu"] * 3
    assert config["optimizer"] == {"type": "Adam", "params": {"lr": 0.001, "weight_decay": 0.05}}
    assert config["gradient_clipping"] == 0.7
    assert config["wall_clock_breakdown"] is False
    assert "scheduler" not in config
    for other in ("fp16", "bf16"):
        assert (other in config) == (other == precision)
        if other == precision:
            assert config[other]["enabled"] is True


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_engine_reads_the_config_as_meant(single_rank_world, fp16_capable_cpu, stage, precision):
    import deepspeed

    args = settings(stage, precision)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=args.deepspeed_config()
    )
    assert engine.zero_optimization_stage() == stage
    assert engine.fp16_enabled() == (precision == "fp16")
    assert engine.bfloat16_enabled() == (precision == "bf16")
    assert engine.train_batch_size() == args.train_batch_size
    assert engine.train_micro_batch_size_per_gpu() == args.train_micro_batch_size_per_gpu
    assert engine.gradient_accumulation_steps() == args.gradient_accumulation_steps
    assert engine.gradient_clipping() == pytest.approx(0.7)
    assert scheduler is None
    for group in optimizer.param_groups:
        assert group["lr"] == pytest.approx(0.001)
    assert {group["weight_decay"] for group in optimizer.param_groups} == {0.05}


def test_extra_args_are_deep_merged_and_may_not_override():
    args = settings(2, "bf16", deepspeed_extra_args={
        "zero_optimization": {"reduce_bucket_size": 1000},
        "bf16": {"immediate_grad_update": True},
        "flops_profiler": {"enabled": False},
    })
    config = args.deepspeed_config()
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert config["bf16"] == {"enabled": True, "immediate_grad_update": True}
    assert config["flops_profiler"] == {"enabled": False}
    with pytest.raises(ConfigError, match=r"deepspeed_extra_args: zero_optimization.stage = 3 would override"):
        settings(2, "bf16", deepspeed_extra_args={"zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError, match=r"deepspeed_extra_args: fp16 = .* set it through fp16 / precision"):
        settings(0, "fp32", deepspeed_extra_args={"fp16": {"enabled": True}})


def test_gpt_neox_deepspeed_keys_go_into_the_deepspeed_config_when_not_default(single_rank_world):
    import deepspeed

    config = settings(0, "bf16").deepspeed_config()
    assert "communication_data_type" not in config and "data_types" not in config  # only non-defaults
    data_types = {"grad_accum_dtype": "fp32"}
    assert settings(1, "bf16", data_types=data_types).deepspeed_config()["data_types"] == data_types
    config = settings(0, "bf16", fp32_allreduce=True, gradient_predivide_factor=2.0).deepspeed_config()
    model = torch.nn.Linear(8, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.communication_data_type == torch.float32  # bf16 gradients are reduced in fp32
    assert engine.gradient_predivide_factor() == 2.0
    with pytest.raises(ConfigError, match=r"fp32_allreduce: true but communication_data_type is 'fp16'"):
        settings(0, "fp32", fp32_allreduce=True, communication_data_type="fp16")
    with pytest.raises(ConfigError, match=r"deepspeed_extra_args: gradient_predivide_factor = 3.0 would override"):
        settings(0, "fp32", gradient_predivide_factor=2.0, deepspeed_extra_args={"gradient_predivide_factor": 3.0})
