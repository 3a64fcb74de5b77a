"""Every reason given for a GPT-NeoX key that is ignored or refused (megatron/neox_arguments/foreign.py)
must be true of what the schema builds today.

The check is data: what the schema supports (SUPPORTED_FEATURES, each proven by a setting of the
schema), and what reasons say (claims that a feature is off, fixed or not built; settings a reason
tells the user to set). A reason that denies a supported feature, names an "off" feature that could
be on, or points at a setting that does not exist fails here.
"""

from __future__ import annotations

import re

import pytest
import yaml

from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.foreign import (
    GLOBAL_ATTENTION,
    GPT_NEOX_ONLY_VALUES,
    INERT,
    TENSOR_PARALLEL_ONLY,
    UNSUPPORTED,
)
from megatron.neox_arguments.schema import SETTINGS

# A phrase a reason may use for a feature -> the setting of the schema that builds it here.
SUPPORTED_FEATURES = {
    "tensor parallelism": "model_parallel_size",
    "tensor-parallel": "model_parallel_size",
    "model parallelism": "model_parallel_size",
    "pipeline parallelism": "pipe_parallel_size",
    "pipeline": "pipe_parallel_size",
    "activation checkpointing": "checkpoint_activations",
    "ZeRO": "zero_optimization",
    "sliding window": "sliding_window_width",
    "grouped-query attention": "num_kv_heads",
    "rotary": "pos_emb",
    "RMSNorm": "norm",
    "swiglu": "activation",
    "DPO": "dpo_beta",
    "KTO": "kto_beta",
    "reward model": "z_loss",
    "torch.compile": "torch_compile",
    "TensorBoard": "tensorboard_dir",
    "W&B": "use_wandb",
    "profiler": "profile",
    "fp16": "fp16",
    "bf16": "bf16",
}
# What a reason says to deny a feature right after naming it ("X is fixed at 1", "X, which is off").
DENIAL = re.compile(r"^\W*(?:,\s*which\s+)?(?:is|are)\s+(?:always\s+|fixed\b|not\b|off\b|unsupported\b|never\b)")
# "only matters with X, which is off": X must be a feature that is refused when switched on.
ONLY_WITH = re.compile(r"only matters with (.+), which is off")
NAME_AND_VALUE = re.compile(r"\b([a-z][a-z0-9_]*):\s*(\{.*\}|[\w.-]+)")
SETTING_NAME = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")
INSTRUCTION = re.compile(r"\b(?:use|set|remove)\s+([^;()]+)")

TINY_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32}


def _reasons() -> list[tuple[str, str]]:
    """(where, text) of every reason foreign.py gives for a GPT-NeoX key or value."""
    reasons = [(f"INERT[{name}]", reason) for name, reason in INERT.items()]
    reasons += [("attention_config", GLOBAL_ATTENTION)]
    reasons += [(f"UNSUPPORTED[{name}]", message) for name, (_, message) in UNSUPPORTED.items()]
    for name, rule in TENSOR_PARALLEL_ONLY.items():
        reasons += [(f"TENSOR_PARALLEL_ONLY[{name}]", text) for text in (rule.built, rule.other, rule.instead)]
    reasons += [(f"GPT_NEOX_ONLY_VALUES[{name}][{value}]", feature)
                for name, values in GPT_NEOX_ONLY_VALUES.items() for value, feature in values.items()]
    return reasons


REASONS = _reasons()


def _is_refused(name: str, value) -> bool:
    """Whether a run that sets `name` to `value` is refused before it starts."""
    try:
        NeoXArgs.from_dict({**TINY_MODEL, name: value})
    except ConfigError:
        return True
    return False


def _parsed(text: str):
    """The value as a config file would give it."""
    return yaml.safe_load(text)


def test_the_supported_features_are_settings_of_the_schema():
    # the table above is evidence only while each setting exists; drop a row whose setting is gone
    assert [setting for setting in SUPPORTED_FEATURES.values() if setting not in SETTINGS] == []


@pytest.mark.parametrize(("where", "reason"), REASONS, ids=[where for where, _ in REASONS])
def test_no_reason_denies_a_feature_the_schema_builds(where, reason):
    for phrase, setting in SUPPORTED_FEATURES.items():
        for found in re.finditer(re.escape(phrase), reason):
            assert not DENIAL.match(reason[found.end():]), (
                f"{where}: {reason!r} says {phrase} is off, fixed or not built, but the schema builds it ({setting})")


@pytest.mark.parametrize(("where", "reason"), REASONS, ids=[where for where, _ in REASONS])
def test_a_feature_called_off_cannot_be_switched_on(where, reason):
    claim = ONLY_WITH.search(reason)
    if claim is None:
        return
    feature = claim.group(1)
    for name, value in NAME_AND_VALUE.findall(feature):
        assert _is_refused(name, _parsed(value)), f"{where}: {reason!r}, but {name}: {value} is accepted here"
    for name in SETTING_NAME.findall(NAME_AND_VALUE.sub("", feature)):
        assert name not in SETTINGS, f"{where}: {reason!r}, but {name} is a setting of the schema and may be on"
        assert name in UNSUPPORTED, f"{where}: {reason!r}, but nothing refuses {name} when it is on"


@pytest.mark.parametrize(("where", "reason"), REASONS, ids=[where for where, _ in REASONS])
def test_what_a_reason_tells_the_user_to_set_exists(where, reason):
    for instruction in INSTRUCTION.findall(reason):
        for name, value in NAME_AND_VALUE.findall(instruction):
            if name in SETTINGS:
                assert not _is_refused(name, _parsed(value)), f"{where}: {reason!r}, but {name}: {value} is refused"
            elif name in UNSUPPORTED:
                assert UNSUPPORTED[name][0](_parsed(value)), f"{where}: {reason!r}, but {name}: {value} is refused"
            else:
                assert name in TENSOR_PARALLEL_ONLY and TENSOR_PARALLEL_ONLY[name].is_built(_parsed(value)), (
                    f"{where}: {reason!r} names {name}, which is no setting here")
        for name in SETTING_NAME.findall(NAME_AND_VALUE.sub("", instruction)):
            known = name in SETTINGS or name in UNSUPPORTED or name in TENSOR_PARALLEL_ONLY
            assert known, f"{where}: {reason!r} names {name}, which is no setting here"


def test_the_check_catches_the_explanation_that_stopped_being_true():
    # the reason sequence_parallel and output_layer_parallelism gave before tensor parallelism landed
    stale = "only matters for tensor parallelism, which is fixed at 1"
    with pytest.raises(AssertionError, match="tensor parallelism is off, fixed or not built"):
        test_no_reason_denies_a_feature_the_schema_builds("stale", stale)
