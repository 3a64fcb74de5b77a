"""PEFT adapter folders in and out: the key names PEFT itself gives, a run that starts from a folder PEFT saved
(its first logits are PeftModel's), and every bad folder refused in one line naming the file and key."""

from __future__ import annotations

import json
from pathlib import Path

import deepspeed
import pytest
import torch
import yaml
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from megatron.checkpointing import (
    CheckpointError,
    LoadSettings,
    LoraBase,
    load_checkpoint,
    plan_load,
    plan_reference,
)
from megatron.contract.lora_settings import lora_settings
from megatron.hf import HF_FOLDER, HFConversionError
from megatron.hf.convert import convert_hf_to_neox
from megatron.hf.io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from megatron.hf.peft import peft_names
from megatron.launch.run_context import settings_for_run
from megatron.model import build_model
from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.optim.optimizers import build_param_groups
from tests.ckpt_engines import hf_settings, make_args, saved_checkpoint, tiny_hf_model

VOCAB = 96
RANK, ALPHA = 4, 12  # a scaling of 3: alpha / r matters


def save_base(folder: Path, family: str) -> Path:
    """A tiny HF model with every weight random (norms too), saved as transformers saves it."""
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=48, num_key_value_heads=2, **common))
    else:
        model = GPTNeoXForCausalLM(GPTNeoXConfig(intermediate_size=64, rotary_pct=0.5, **common))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


def peft_model(base: Path, targets):
    """PEFT's model over the base folder, its adapters random (B too, so they change the logits)."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))


CASES = [("llama", "all-linear"), ("llama", ["k_proj", "up_proj"]), ("gpt_neox", None)]


@pytest.mark.parametrize(("family", "targets"), CASES, ids=str)
def test_our_adapter_names_are_the_keys_peft_saves(family, targets, tmp_path):
    base = save_base(tmp_path / "base", family)
    saved = tmp_path / "adapter"
    peft_model(base, targets).save_pretrained(saved)
    config = json.loads((saved / ADAPTER_CONFIG_NAME).read_text())
    gpt_neox = family == "gpt_neox"
    lora = lora_settings({"lora_rank": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "lora_target_modules": targets,
                          "lora_use_rslora": False, "norm": "layernorm" if gpt_neox else "rmsnorm",
                          "activation": "gelu" if gpt_neox else "swiglu"})
    assert config["r"] == RANK
    assert set(peft_names(lora, family, 2).values()) == set(load_file(saved / ADAPTER_WEIGHTS_NAME))


def run_settings(tmp_path: Path, **settings):
    """The settings deepy.py resolves for a run of `settings` (a config file) on this vocabulary."""
    path = tmp_path / "run.yml"
    path.write_text(yaml.safe_dump({"finetune": True, "train_iters": 1, "train_micro_batch_size_per_gpu": 2,
                                    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "hidden_dropout": 0.0,
                                    "attention_dropout": 0.0, "seq_length": 16, "embedded_corpus": True, **settings}))
    return settings_for_run([str(path)]).with_values({"padded_vocab_size": VOCAB}, "test")


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.parametrize(("family", "targets"), CASES, ids=str)
def test_a_run_from_a_peft_folder_takes_its_lora_and_base_and_starts_with_peft_logits(family, targets, tmp_path):
    base = save_base(tmp_path / "base", family)
    theirs = peft_model(base, targets)
    folder = tmp_path / "adapter"
    theirs.save_pretrained(folder)  # base_model_name_or_path: the base folder it was loaded from
    args = run_settings(tmp_path, load=str(folder))
    lora = args.lora()
    assert (lora.rank, lora.alpha, lora.scaling) == (RANK, ALPHA, ALPHA / RANK)
    assert args.num_layers == 2 and args.source_of("lora_rank") == str(folder / ADAPTER_CONFIG_NAME)
    plan = plan_load(args, 1, hf_source=HF_FOLDER)
    assert not plan.fresh_adapters and f"LoRA adapters of PEFT's folder {folder}" in plan.describe()
    model = build_model(args.architecture(), args.seed, lora=lora)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=build_param_groups(model, 0.0),
                                      config={"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                                              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    load_checkpoint(engine, plan)
    with torch.no_grad():
        ours = engine.module.eval()(tokens())
        expected = theirs(input_ids=tokens()).logits
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_the_reference_identity_of_a_start_from_a_peft_folder_covers_the_base_files_too(llama_adapter, tmp_path):
    """What DPO/KTO record of the model they start from (reference.py), here with the base outside the folder."""
    args = run_settings(tmp_path, load=str(llama_adapter))
    plan = plan_load(args, 1, hf_source=HF_FOLDER)
    _, identity = plan_reference(LoadSettings.from_args(args), plan, 1, hf_source=HF_FOLDER)
    base = HF_FOLDER.adapter_base(llama_adapter)
    (base / "config.json").write_text((base / "config.json").read_text() + " ")  # the base changes
    replanned = plan_load(args, 1, hf_source=HF_FOLDER)  # as the next start plans it (a plan sums its files once)
    assert plan_reference(LoadSettings.from_args(args), replanned, 1, hf_source=HF_FOLDER)[1].checksum != identity.checksum


@pytest.fixture
def llama_adapter(tmp_path) -> Path:
    base = save_base(tmp_path / "base", "llama")
    folder = tmp_path / "adapter"
    peft_model(base, ["q_proj", "down_proj"]).save_pretrained(folder)
    return folder


def _edit_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / ADAPTER_WEIGHTS_NAME)
    edit(tensors)
    save_file(tensors, folder / ADAPTER_WEIGHTS_NAME)


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / ADAPTER_CONFIG_NAME).read_text())
    (folder / ADAPTER_CONFIG_NAME).write_text(json.dumps({**config, **changes}))


Q_A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
BAD_WEIGHTS = [
    (lambda t: t.pop(Q_A), f"{Q_A} is missing (1 missing, 0 unexpected keys"),
    (lambda t: t.update({Q_A.replace("q_proj", "v_proj"): t[Q_A].clone()}),
     f"{Q_A.replace('q_proj', 'v_proj')} is no adapter of the run's LoRA"),
    (lambda t: t.update({Q_A: t[Q_A][:, :-1].clone()}), f"{Q_A} has shape (4, 31), the base's module and r 4 give (4, 32)"),
    (lambda t: t[Q_A].__setitem__((0, 0), float("nan")), f"{Q_A} holds values that are not finite"),
]


@pytest.mark.parametrize(("edit", "message"), BAD_WEIGHTS + [(None, "cannot be read as safetensors")],
                         ids=["missing", "extra", "shape", "nan", "truncated"])
def test_adapter_weights_that_are_not_the_configs_adapters_are_refused_in_one_line(llama_adapter, edit, message,
                                                                                   tmp_path):
    if edit is None:
        weights = llama_adapter / ADAPTER_WEIGHTS_NAME
        weights.write_bytes(weights.read_bytes()[:200])
    else:
        _edit_weights(llama_adapter, edit)
    args = run_settings(tmp_path, load=str(llama_adapter))
    with pytest.raises(HFConversionError) as caught:
        HF_FOLDER.read_weights(llama_adapter, args.architecture())
    assert str(caught.value).startswith(f"{llama_adapter / ADAPTER_WEIGHTS_NAME}: {message}")
    assert "\n" not in str(caught.value)


BAD_CONFIGS = [
    ({"use_dora": True}, "use_dora is True; only plain LoRA adapters on the linear layers load here"),
    ({"layers_to_transform": 0}, "layers_to_transform is 0; only plain LoRA adapters"),
    ({"peft_type": "IA3"}, "peft_type is 'IA3'; only LoRA adapters"),
    ({"target_modules": ".*proj"}, "target_modules is the pattern '.*proj'"),
    ({"base_model_name_or_path": None}, "base_model_name_or_path is not set; set it to the local Hugging Face"),
    ({"base_model_name_or_path": "meta-llama/Llama-3.2-1B"},
     "base_model_name_or_path 'meta-llama/Llama-3.2-1B' is no local Hugging Face model folder"),
    ({"target_modules": ["q_proj", "query_key_value"]},
     "lora_target_modules: 'query_key_value' names no linear module of this Llama-family model"),
    ({"target_parameters": ["mlp.experts.w1"]},
     "target_parameters is ['mlp.experts.w1']; only the experts' gate_up_proj and down_proj"),
    ({"target_parameters": ["mlp.experts.down_proj"]},  # a dense base: no experts
     "lora_target_modules: 'experts.down_proj' names no linear module of this Llama-family model"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_CONFIGS, ids=lambda v: str(v)[:30])
def test_an_adapter_config_this_trainer_cannot_compute_is_refused_in_one_line(llama_adapter, changes, message,
                                                                              tmp_path):
    _edit_config(llama_adapter, **changes)
    with pytest.raises(ConfigError) as caught:
        run_settings(tmp_path, load=str(llama_adapter))
    assert f"{llama_adapter / ADAPTER_CONFIG_NAME}: {message}" in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("settings", "message"), [
    ({"lora_rank": 8}, "lora_rank is 8, but {config} says r 4; leave lora_rank unset"),
    ({"lora_alpha": 4}, "lora_alpha is 4.0, but {config} says lora_alpha 12.0"),
    ({"lora_target_modules": "all-linear"}, "lora_target_modules is ['q_proj', 'k_proj', 'v_proj', 'o_proj', "
                                            "'gate_proj', 'up_proj', 'down_proj'], but {config} says target_modules "
                                            "['q_proj', 'down_proj']"),
    ({"lora_rank": 0}, "lora_rank is 0, but `load` {folder} is a PEFT LoRA adapter folder"),
])
def test_lora_settings_that_disagree_with_the_folder_are_refused(llama_adapter, settings, message, tmp_path):
    with pytest.raises(ConfigError) as caught:
        run_settings(tmp_path, load=str(llama_adapter), **settings)
    expected = message.format(config=llama_adapter / ADAPTER_CONFIG_NAME, folder=llama_adapter)
    assert str(caught.value).startswith(f"{tmp_path / 'run.yml'}: {expected}"), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_folder_peft_loads_needs_no_more_than_safetensors_and_json(llama_adapter):
    """What PeftModel.from_pretrained reads of a folder is what we read: the same adapters and base."""
    base = json.loads((llama_adapter / ADAPTER_CONFIG_NAME).read_text())["base_model_name_or_path"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), llama_adapter)
    assert HF_FOLDER.adapter_base(llama_adapter) == Path(base)
    assert {name for name, _ in loaded.named_parameters() if ".lora_" in name}


@pytest.mark.usefixtures("single_rank_world")
def test_a_lora_runs_base_names_the_hugging_face_folder_that_holds_it(tmp_path):
    hf_dir = tiny_hf_model(tmp_path / "hf")
    from_hf = NeoXArgs.from_dict({**hf_settings(hf_dir), "lora_rank": 4, "finetune": True, "load": str(hf_dir)})
    base = plan_load(from_hf, 1, hf_source=HF_FOLDER).lora_base
    assert (base.source, base.tag, base.hf_folder) == (str(hf_dir), None, str(hf_dir)) and base.checksum
    convert_hf_to_neox(hf_dir, tmp_path / "converted")  # a tag holding exactly the folder's weights
    base = plan_load(from_hf.with_values({"load": str(tmp_path / "converted")}, "test"), 1).lora_base
    assert (base.source, base.tag, base.hf_folder) == (str(tmp_path / "converted"), "global_step0", str(hf_dir))
    assert plan_load(from_hf.with_values({"lora_rank": 0}, "test"), 1, hf_source=HF_FOLDER).lora_base is None

    saved_checkpoint(tmp_path / "plain", make_args(save=str(tmp_path / "plain")))  # trained here: no HF folder
    finetune = make_args(lora_rank=4).with_values({"load": str(tmp_path / "plain"), "finetune": True}, "test")
    base = plan_load(finetune, 1).lora_base
    assert (base.source, base.tag, base.hf_folder) == (str(tmp_path / "plain"), "global_step1", None)
    scratch = make_args(lora_rank=4, save=str(tmp_path / "scratch"))  # a LoRA run from scratch: full tags, no base
    saved_checkpoint(tmp_path / "scratch", scratch)
    assert plan_load(scratch.with_values({"load": str(tmp_path / "scratch")}, "test"), 1).lora_base is None


def test_a_run_from_a_peft_folder_names_the_base_it_names_checksummed_as_that_folder_alone(llama_adapter, tmp_path):
    """The saves of a run started from a PEFT folder are adapter-only over the model folder the adapters sit on:
    the checksum a resume checks that folder against is the one of a load of that folder itself."""
    args = run_settings(tmp_path, load=str(llama_adapter))
    base = HF_FOLDER.adapter_base(llama_adapter)
    recorded = plan_load(args, 1, hf_source=HF_FOLDER).lora_base
    over_base = plan_load(args.with_values({"load": str(base)}, "test"), 1, hf_source=HF_FOLDER).lora_base
    assert recorded == over_base == LoraBase(str(base), None, over_base.checksum, str(base))


# --- the base under a PEFT folder's adapters (lora_base.json) ----------------------------------------------------

def test_a_peft_folder_without_a_base_record_loads_and_the_plan_says_its_base_cannot_be_verified(llama_adapter,
                                                                                                  tmp_path):
    plan = plan_load(run_settings(tmp_path, load=str(llama_adapter)), 1, hf_source=HF_FOLDER)
    base = HF_FOLDER.adapter_base(llama_adapter)
    assert (f"note:   no lora_base.json beside {llama_adapter / ADAPTER_CONFIG_NAME} (a PEFT folder written "
            f"elsewhere): its base {base} cannot be verified to be the model the adapters were trained over"
            in plan.describe())


def _record_base(folder: Path) -> Path:
    """The record an export writes, made by hand from what identity.py documents: the base's files' checksum as
    the load plan of that very folder computes it (LoadPlan.weights_checksum)."""
    base = HF_FOLDER.adapter_base(folder)
    base_args = NeoXArgs.from_dict({**hf_settings(base), "finetune": True, "load": str(base)})
    checksum = plan_load(base_args, 1, hf_source=HF_FOLDER).weights_checksum
    record = {"source": str(base), "tag": None, "checksum": checksum, "hf_folder": str(base)}
    (folder / "lora_base.json").write_text(json.dumps(record))
    return base


def test_a_peft_folder_whose_base_changed_since_its_export_is_refused_in_one_line(llama_adapter, tmp_path):
    base = _record_base(llama_adapter)
    args = run_settings(tmp_path, load=str(llama_adapter))
    assert f"base {base} checked against {llama_adapter / 'lora_base.json'}" in plan_load(args, 1, hf_source=HF_FOLDER).describe()
    tensors = load_file(base / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] += 0.01  # the base is fine-tuned further under the adapters
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as caught:
        plan_load(args, 1, hf_source=HF_FOLDER)
    message = str(caught.value)
    assert message.startswith(f"{llama_adapter / 'lora_base.json'}: the adapters were trained over a base whose "
                              "files' checksum is ")
    assert f"but their base {base} now gives " in message and "Restore the base they were trained over" in message
    assert "\n" not in message


def test_a_damaged_base_record_is_one_line(llama_adapter, tmp_path):
    (llama_adapter / "lora_base.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"lora_base\.json: cannot be read as JSON .* delete it to load them "
                                              r"unverified$"):
        plan_load(run_settings(tmp_path, load=str(llama_adapter)), 1, hf_source=HF_FOLDER)


def test_a_peft_folder_whose_rank_exceeds_the_base_layers_is_refused_with_the_bound_not_an_allocation(llama_adapter,
                                                                                                      tmp_path):
    _edit_config(llama_adapter, r=10**9)
    with pytest.raises(ConfigError) as caught:
        run_settings(tmp_path, load=str(llama_adapter))
    assert str(caught.value).startswith(f"{llama_adapter / ADAPTER_CONFIG_NAME}: lora_rank: 1000000000 is above 32, "
                                        "the smaller side of the adapted layer q_proj (32 x 32)")  # 4 heads of 8
    assert "\n" not in str(caught.value)
