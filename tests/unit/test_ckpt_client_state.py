"""The client state: what our saves write reads back, and older or foreign layouts still read."""

import argparse

import pytest

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk.client_state import ClientState
from megatron.checkpointing.ondisk.identity import LoraBase
from megatron.checkpointing.ondisk.rng import collect_rng_states


def test_what_is_written_reads_back():
    state = ClientState(iteration=7, consumed_train_samples=56, settings={"hidden_size": 8},
                        rng_states=[collect_rng_states()], lr_schedule_start=3,
                        forward_validation={"precision": "fp32"},
                        lora_base={"source": "/models/llama", "tag": None, "checksum": "0123456789abcdef",
                                   "hf_folder": "/models/llama"})
    written = state.to_dict()
    assert written["checkpoint_format_version"] == 2 and written["lr_schedule_start_iteration"] == 3
    assert "converted_from" not in written  # unset optional fields are not written
    assert ClientState.from_dict(written) == state


def test_a_lora_base_reads_back_and_one_recorded_without_its_hugging_face_folder_reads():
    base = LoraBase("/runs/base", "global_step2", "0123456789abcdef", "/models/llama")
    assert LoraBase.from_dict(base.to_dict(), "tag") == base and set(base.to_dict()) == {"source", "tag", "checksum", "hf_folder"}
    without = LoraBase.from_dict({"source": "/runs/base", "tag": "global_step2", "checksum": "0123456789abcdef"},
                                 "tag")
    assert without.hf_folder is None and without.path.as_posix() == "/runs/base/global_step2"


def test_format_1_checkpoint_without_schedule_start_reads():
    # The keys our saves wrote before the LR-schedule start was recorded.
    stored = {"checkpoint_format_version": 1, "iteration": 20, "consumed_train_samples": 160,
              "args": {"num_layers": 2}, "rng_states": [{"python": None}]}
    state = ClientState.from_dict(stored)
    assert (state.iteration, state.consumed_train_samples, state.lr_schedule_start) == (20, 160, 0)
    assert state.settings == {"num_layers": 2} and len(state.rng_states) == 1 and state.format_version == 1
    state.check_readable("file")


def test_format_1_settings_read_in_gpt_neox_meaning():
    # format 1 saved the MLP width per projection as built; GPT-NeoX's rule builds it from 3x with multiple 1
    swiglu = ClientState.from_dict({"checkpoint_format_version": 1,
                                    "args": {"activation": "swiglu", "intermediate_size": 40, "mlp_multiple_of": 256}})
    assert (swiglu.settings["intermediate_size"], swiglu.settings["mlp_multiple_of"]) == (120, 1)
    gelu = ClientState.from_dict({"checkpoint_format_version": 1, "args": {"activation": "gelu", "intermediate_size": 64}})
    assert (gelu.settings["intermediate_size"], gelu.settings["mlp_multiple_of"]) == (64, 1)
    current = {"activation": "swiglu", "intermediate_size": 40, "mlp_multiple_of": 8}
    assert ClientState.from_dict({"checkpoint_format_version": 2, "args": current}).settings == current
    assert ClientState.from_dict({"args": current}).settings == current  # GPT-NeoX's own: its meaning already


def test_gpt_neox_client_state_reads_as_far_as_its_keys_go():
    stored = {"iteration": 30, "args": {"num_layers": 2, "padded_vocab_size": 64},
              "random_rng_state": (3, (1,), None), "data_loading": {"train": 1}}
    state = ClientState.from_dict(stored)
    assert (state.iteration, state.consumed_train_samples, state.rng_states, state.format_version) == (
        30, None, None, None)
    assert state.settings["padded_vocab_size"] == 64


def test_megatron_namespace_settings_become_a_dict():
    state = ClientState.from_dict({"args": argparse.Namespace(num_layers=4)})
    assert state.settings == {"num_layers": 4}


def test_a_newer_format_is_refused_by_name():
    state = ClientState.from_dict({"checkpoint_format_version": 99})
    with pytest.raises(CheckpointError, match="ckpt/mp_rank_00_model_states.pt was written in checkpoint format 99"):
        state.check_readable("ckpt/mp_rank_00_model_states.pt")
