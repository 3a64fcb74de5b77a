"""End to end: a LoRA fine-tune of a Hugging Face Llama folder through deepy.py, exported by
tools/ckpts/convert_neox_to_hf.py as a PEFT folder (PeftModel gives our logits) or merged (in fp32, then
cast), and a new run started from the PEFT folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron.checkpointing import inventory_checkpoint, read_full_module_weights, read_module_weights
from megatron.contract.lora_settings import lora_settings
from megatron.hf import HF_FOLDER
from megatron.hf.config import architecture_of
from megatron.hf.convert import convert_hf_to_neox
from megatron.hf.io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from megatron.model import build_model
from tests.ckpt_engines import stored_client_state
from tests.deepy_runs import REPO_ROOT, run_deepy, train_lines, write_overrides

pytestmark = pytest.mark.e2e

VOCAB = 4096  # the embedded corpus's tokenizer
LORA = {"lora_rank": 4, "lora_alpha": 12, "lora_target_modules": "all-linear"}  # scaling 3: alpha / r matters
RUN = {"finetune": True, "embedded_corpus": True, "eval_interval": 1000, "seq_length": 32, "precision": "fp32",
       "optimizer": {"type": "Adam", "params": {"lr": 0.02}}, "hidden_dropout": 0.0, "attention_dropout": 0.0}


def save_llama(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=False))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(the HF base folder, the tag of a 2-step LoRA fine-tune of it)."""
    directory = tmp_path_factory.mktemp("lora_run")
    hf_dir = save_llama(directory / "hf")
    run_deepy([write_overrides(directory, load=str(hf_dir), save=str(directory / "run"), train_iters=2,
                               checkpoint_factor=2, **RUN, **LORA)])
    return hf_dir, directory / "run" / "global_step2"


def export(source: Path, output: Path, *options: str) -> subprocess.CompletedProcess:
    """tools/ckpts/convert_neox_to_hf.py as a user runs it, with PEFT not importable: the export needs none."""
    program = ("import runpy, sys; sys.modules['peft'] = None; sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", program, str(REPO_ROOT / "tools/ckpts/convert_neox_to_hf.py"),
                           "--input", str(source), "--output", str(output), *options],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def our_logits(tag_dir: Path, batch: torch.Tensor) -> torch.Tensor:
    """Our model with the tag's weights and adapters (over the base an adapter-only tag records), its
    tensor-parallel parts joined, in one process (fp32)."""
    state = stored_client_state(tag_dir)
    saved = state["args"]
    arch = architecture_of({**saved, "model_parallel_size": 1})
    model = build_model(arch, seed=1, lora=lora_settings(saved))
    weights = read_full_module_weights(tag_dir, saved["model_parallel_size"], arch)
    base = state.get("lora_base")
    if base and base["tag"] is None:  # a Hugging Face folder
        weights = {**HF_FOLDER.read_weights(Path(base["source"]), arch), **weights}
    elif base:
        base_tag = Path(base["source"]) / base["tag"]
        base_size = stored_client_state(base_tag)["args"]["model_parallel_size"]
        weights = {**read_full_module_weights(base_tag, base_size, arch), **weights}
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.eval()(batch)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))


def hf_logits(model, batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=batch).logits


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.slow
def test_the_peft_export_loads_in_peft_model_and_gives_our_logits(lora_run, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    hf_dir, tag_dir = lora_run
    out = tmp_path / "adapter"
    result = export(tag_dir.parent, out, "--peft")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / ADAPTER_CONFIG_NAME).read_text())
    assert {key: config[key] for key in ("peft_type", "task_type", "r", "lora_alpha", "use_rslora")} == \
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 12, "use_rslora": False}
    assert config["base_model_name_or_path"] == str(hf_dir)  # recorded by the run: no --base-model needed
    # the keys PEFT's own save writes for these targets
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir),
                               LoraConfig(r=4, lora_alpha=12, target_modules="all-linear"))
    assert set(load_file(out / ADAPTER_WEIGHTS_NAME)) == {
        name.replace(".default", "") for name in reference.state_dict() if ".lora_" in name}

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), out)
    ours = our_logits(tag_dir, tokens())
    base = hf_logits(AutoModelForCausalLM.from_pretrained(hf_dir), tokens())
    assert (ours - base).abs().max() > 1e-2  # the adapters trained: the check below sees them
    torch.testing.assert_close(hf_logits(loaded, tokens()), ours, atol=1e-5, rtol=0)


@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.slow
def test_the_merged_export_gives_our_logits_and_rounds_the_fp32_merge_once(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir, tag_dir = lora_run
    for dtype in ("fp32", "bf16"):
        result = export(tag_dir.parent, tmp_path / dtype, "--dtype", dtype)
        assert result.returncode == 0, result.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    torch.testing.assert_close(hf_logits(merged, tokens()), our_logits(tag_dir, tokens()), atol=1e-5, rtol=0)

    fp32, bf16 = load_file(tmp_path / "fp32" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    assert sorted(bf16) == sorted(fp32) and all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    # merging in bf16 arithmetic would give other weights: the check above tells the two apart
    base, module = load_file(hf_dir / "model.safetensors"), read_module_weights(tag_dir)
    a, b = (module[f"sequential.2.mlp.linear2.lora.down_proj.lora_{side}"] for side in "AB")
    name = "model.layers.0.mlp.down_proj.weight"
    in_bf16 = base[name].bfloat16() + 3.0 * (b.bfloat16() @ a.bfloat16())
    assert not torch.equal(in_bf16, bf16[name])


@pytest.mark.slow
def test_the_merged_export_reads_the_recorded_base_checked_and_the_peft_export_needs_only_the_adapters(lora_run,
                                                                                                      tmp_path):
    hf_dir, tag_dir = lora_run
    assert inventory_checkpoint(tag_dir.parent).tags[tag_dir.name].saved_layout.adapters_only
    config, moved = hf_dir / "config.json", hf_dir.with_name("moved")
    original = config.read_text()
    try:
        config.write_text(original + " ")  # the same model, but not the bytes the run recorded
        changed = export(tag_dir.parent, tmp_path / "changed")
        config.write_text(original)
        hf_dir.rename(moved)
        gone = export(tag_dir.parent, tmp_path / "gone")
        adapters_alone = export(tag_dir.parent, tmp_path / "adapter", "--peft")
    finally:
        if moved.exists():
            moved.rename(hf_dir)
        config.write_text(original)
    where = f"error: the base model of the LoRA adapters in {tag_dir}, {hf_dir}"
    assert changed.returncode == 1 and changed.stderr.startswith(f"{where}, changed since the run started")
    assert gone.returncode == 1 and gone.stderr.startswith(f"{where}, is gone. The adapters were trained over")
    assert changed.stderr.count("\n") == gone.stderr.count("\n") == 1  # one line each
    assert not (tmp_path / "changed").exists() and not (tmp_path / "gone").exists()
    assert adapters_alone.returncode == 0, adapters_alone.stderr
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_NAME).read_text())["base_model_name_or_path"] == str(hf_dir)


def test_peft_export_of_a_tag_without_adapters_is_refused_in_one_line(lora_run, tmp_path):
    hf_dir, _ = lora_run
    convert_hf_to_neox(hf_dir, tmp_path / "ckpt")
    result = export(tmp_path / "ckpt", tmp_path / "adapter", "--peft")
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: {tmp_path / 'ckpt' / 'global_step0'} holds no LoRA adapters (its run "
                                     "had lora_rank 0); --peft writes adapters only: leave it out to export the model")
    assert not (tmp_path / "adapter").exists()


@pytest.mark.slow
def test_a_run_starts_from_the_peft_folder_over_its_base_and_records_it(lora_run, tmp_path):
    hf_dir, tag_dir = lora_run
    adapter = tmp_path / "adapter"
    assert export(tag_dir.parent, adapter, "--peft").returncode == 0
    result = run_deepy([write_overrides(tmp_path, load=str(adapter), save=str(tmp_path / "next"), train_iters=2,
                                        checkpoint_factor=1, **RUN)])  # no lora_* setting: the folder's
    assert f"LoRA adapters of PEFT's folder {adapter} over their base model {hf_dir}, both loaded" in result.stdout
    unbroken = [(line.iteration, line.loss) for line in train_lines(result.stdout)]
    assert [iteration for iteration, _ in unbroken] == [1, 2]
    saved = stored_client_state(tmp_path / "next" / "global_step1")
    assert {name: saved["args"][name] for name in ("lora_rank", "lora_alpha")} == {"lora_rank": 4, "lora_alpha": 12.0}
    # adapter-only over the base folder the adapters name, which a PEFT export of this run names again
    assert inventory_checkpoint(tmp_path / "next").tags["global_step1"].saved_layout.adapters_only
    assert {key: saved["lora_base"][key] for key in ("source", "tag", "hf_folder")} == \
        {"source": str(hf_dir), "tag": None, "hf_folder": str(hf_dir)}

    # a full resume of its step-1 tag (the adapters over the base folder it records) takes the unbroken step 2
    resumed = run_deepy([write_overrides(tmp_path, name="resume.yml", load=str(tmp_path / "next"), iteration=1,
                                         save=str(tmp_path / "resumed"), train_iters=2, checkpoint_factor=2,
                                         **{**RUN, "finetune": False}, **LORA)])
    assert f"LoRA adapters only, over the base {hf_dir}" in resumed.stdout
    assert [(line.iteration, line.loss) for line in train_lines(resumed.stdout)] == unbroken[1:]


def test_the_peft_export_records_its_base_and_a_load_over_a_changed_base_is_refused(lora_run, tmp_path):
    """The export names the base the run recorded, checksum included, beside adapter_config.json; a copy of the
    export pointed at a copy of the base loads checked, and refuses once that copy's weights change."""
    import shutil

    from megatron.checkpointing import CheckpointError, plan_load
    from megatron.launch.run_context import settings_for_run

    hf_dir, tag_dir = lora_run
    adapter = tmp_path / "adapter"
    assert export(tag_dir.parent, adapter, "--peft").returncode == 0
    recorded = stored_client_state(tag_dir)["lora_base"]
    assert json.loads((adapter / "lora_base.json").read_text()) == {**recorded, "hf_folder": str(hf_dir)}

    base_copy = shutil.copytree(hf_dir, tmp_path / "base_copy")
    config = json.loads((adapter / ADAPTER_CONFIG_NAME).read_text())
    (adapter / ADAPTER_CONFIG_NAME).write_text(json.dumps({**config, "base_model_name_or_path": str(base_copy)}))
    run = write_overrides(tmp_path, load=str(adapter), train_iters=2, **RUN)
    args = settings_for_run([str(run)]).with_values({"padded_vocab_size": VOCAB}, "test")
    assert f"base {base_copy} checked against {adapter / 'lora_base.json'}" in plan_load(args, 1, hf_source=HF_FOLDER
                                                                                         ).describe()
    weights = load_file(base_copy / "model.safetensors")
    weights["model.norm.weight"] *= 1.01
    save_file(weights, base_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"^{adapter / 'lora_base.json'}: the adapters were trained over a base "
                                              rf"whose files' checksum is {recorded['checksum']} "):
        plan_load(args, 1, hf_source=HF_FOLDER)


def test_a_merged_export_never_writes_over_the_base_its_tag_reads_even_with_overwrite(lora_run, tmp_path):
    hf_dir, tag_dir = lora_run
    before = {path.name: path.read_bytes() for path in hf_dir.iterdir()}
    result = export(tag_dir.parent, hf_dir, "--overwrite")
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: --output {hf_dir} is, holds or lies in the input {hf_dir}, which this "
                                     "command reads; write the output to a file or folder of its own")
    assert {path.name: path.read_bytes() for path in hf_dir.iterdir()} == before
