"""End to end: LoRA on a Mixtral folder's experts (and its q_proj) through deepy.py, exported by
tools/ckpts/convert_neox_to_hf.py as a PEFT folder (``target_parameters``; PeftModel on transformers'
MixtralForCausalLM gives our logits) or merged, and read back as a run's warm start."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron.checkpointing import read_module_weights
from megatron.hf import HF_FOLDER
from megatron.hf.config import architecture_of
from megatron.hf.convert import convert_neox_to_hf
from megatron.hf.io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from tests.ckpt_engines import stored_client_state
from tests.deepy_runs import run_deepy, write_overrides
from tests.e2e.test_lora_peft import RUN, VOCAB, export, hf_logits, our_logits, tokens
from tests.unit.test_lora_experts import save_mixtral

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a deepy run and an export: ~2 min here

TARGETS = ["q_proj", "experts.gate_up_proj", "experts.down_proj"]
LORA = {"lora_rank": 2, "lora_alpha": 6, "lora_target_modules": TARGETS}


@pytest.fixture(scope="module")
def experts_run(tmp_path_factory):
    """(the Mixtral base folder, the tag of a 2-step LoRA fine-tune of its attention and experts)."""
    directory = tmp_path_factory.mktemp("lora_experts_run")
    hf_dir = save_mixtral(directory / "hf", vocab=VOCAB)
    run_deepy([write_overrides(directory, load=str(hf_dir), save=str(directory / "run"), train_iters=2,
                               checkpoint_factor=2, **RUN, **LORA)])
    return hf_dir, directory / "run" / "global_step2"


@pytest.mark.usefixtures("single_rank_world")
def test_the_peft_export_of_expert_adapters_loads_in_peft_model_gives_our_logits_and_reads_back(experts_run,
                                                                                                 tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import MixtralForCausalLM

    hf_dir, tag_dir = experts_run
    out = tmp_path / "adapter"
    result = export(tag_dir.parent, out, "--peft")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / ADAPTER_CONFIG_NAME).read_text())
    assert (config["target_modules"], config["target_parameters"]) == (["q_proj"], TARGETS[1:])
    # the keys and shapes PEFT's own model has for these targets
    reference = get_peft_model(MixtralForCausalLM.from_pretrained(hf_dir), LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj"], target_parameters=TARGETS[1:]))
    expected = {name.replace(".default", ""): tuple(p.shape) for name, p in reference.state_dict().items()
                if ".lora_" in name}
    assert {name: tuple(t.shape) for name, t in load_file(out / ADAPTER_WEIGHTS_NAME).items()} == expected

    loaded = PeftModel.from_pretrained(MixtralForCausalLM.from_pretrained(config["base_model_name_or_path"]), out)
    ours = our_logits(tag_dir, tokens())
    base = hf_logits(MixtralForCausalLM.from_pretrained(hf_dir), tokens())
    assert (ours - base).abs().max() > 1e-3  # the adapters trained: the check below sees them
    torch.testing.assert_close(hf_logits(loaded, tokens()), ours, atol=1e-5, rtol=0)

    # a run's warm start from the folder: the adapters in our layout, as the tag holds them
    arch = architecture_of({**stored_client_state(tag_dir)["args"], "model_parallel_size": 1})
    weights = HF_FOLDER.read_weights(out, arch)
    trained = {name: value for name, value in read_module_weights(tag_dir).items() if ".lora." in name}
    assert any(".experts.mlp.lora." in name for name in trained)
    for name, value in trained.items():
        assert torch.equal(weights[name], value.float()), name


@pytest.mark.usefixtures("single_rank_world")
def test_the_merged_export_adds_each_experts_adapters_and_gives_our_logits(experts_run, tmp_path):
    from transformers import MixtralForCausalLM

    _, tag_dir = experts_run
    convert_neox_to_hf(tag_dir.parent, tmp_path / "merged", dtype="fp32")
    merged = MixtralForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(hf_logits(merged, tokens()), our_logits(tag_dir, tokens()), atol=1e-5, rtol=0)
