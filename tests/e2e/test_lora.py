"""End to end: LoRA fine-tunes of a tiny checkpoint through deepy.py, as a user starts them."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from megatron.checkpointing import inventory_checkpoint, load_file_weights_only, read_module_weights
from megatron.checkpointing.ondisk import layout
from megatron.hf.convert import convert_neox_to_hf
from megatron.hf.io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from tests.deepy_runs import TRAIN_LINE, run_deepy, train_lines, write_overrides
from tests.e2e.test_hf_conversion import run_tool
from tests.e2e.test_lora_peft import LORA as PEFT_LORA
from tests.e2e.test_lora_peft import RUN, export, hf_logits, our_logits, save_llama, tokens

pytestmark = pytest.mark.e2e

LORA = {"lora_rank": 4, "lora_alpha": 8, "lora_target_modules": "all-linear", "eval_interval": 1000,
        "lr_decay_iters": 4}  # one schedule for the fine-tune and its resume


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny fp32 ZeRO-1 checkpoint without adapters, after 2 steps."""
    directory = tmp_path_factory.mktemp("base")
    save = directory / "ckpt"
    run_deepy(["configs/tiny.yml", write_overrides(directory, save=str(save), train_iters=2, checkpoint_factor=2,
                                                   eval_interval=1000)])
    return save


def _tag_bytes(tag_dir) -> int:
    return sum(path.stat().st_size for path in tag_dir.rglob("*.pt"))


@pytest.mark.usefixtures("single_rank_world")  # our_logits builds the model in-process
@pytest.mark.slow
def test_a_lora_finetune_saves_adapter_only_tags_that_resume_bit_identically(base, tmp_path):
    out = tmp_path / "lora"
    unbroken = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, load=str(base), save=str(out), finetune=True,
                                                              train_iters=4, checkpoint_factor=2, **LORA)])
    assert "LoRA adapters (A drawn from the seed, B zero" in unbroken.stdout  # the load plan says they start fresh
    tag = out / "global_step2"
    tuned = read_module_weights(tag)
    assert tuned and all(".lora." in name for name in tuned), "the tag holds more than the adapters"
    assert all(tuned[name].any() for name in tuned if name.endswith("lora_B")), "an adapter did not train"
    lora_base = inventory_checkpoint(out).tags["global_step2"].saved_layout.lora_base
    assert lora_base.path == base / "global_step2"
    assert _tag_bytes(tag) * 10 < _tag_bytes(base / "global_step2")  # no frozen weights in it

    saved = tmp_path / "copy"  # the step-2 tag alone, as someone copies it to resume
    shutil.copytree(tag, saved / "global_step2")
    (saved / "latest").write_text("global_step2")
    resumed = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, name="resume.yml", load=str(saved),
                                                             save=str(tmp_path / "resumed"), train_iters=4,
                                                             checkpoint_factor=4, **LORA)])
    assert f"LoRA adapters only, over the base {base / 'global_step2'})" in resumed.stdout
    assert [(line.iteration, line.loss) for line in train_lines(resumed.stdout)] == \
        [(line.iteration, line.loss) for line in train_lines(unbroken.stdout) if line.iteration > 2]

    inspected = run_tool("inspect_checkpoint.py", saved)
    assert inspected.returncode == 0, inspected.stderr
    assert (f"LoRA adapters only (the parameters that train), over the base {base} tag global_step2 "
            f"(checksum {lora_base.checksum})") in inspected.stdout

    # a new run from the adapters' weights: their optimizer starts fresh, its saves name the same base
    again = tmp_path / "again"
    finetuned = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, name="again.yml", load=str(saved),
                                                               save=str(again), finetune=True, train_iters=1,
                                                               checkpoint_factor=1, **LORA)])
    assert "loaded: LoRA adapters" in finetuned.stdout and "fresh:  optimizer states" in finetuned.stdout
    assert inventory_checkpoint(again).tags["global_step1"].saved_layout.lora_base == lora_base

    # its base was trained here, so no Hugging Face folder holds it: a PEFT export (the adapters alone) asks for
    # one, checked; the merged export reads the base where the tag recorded it
    refused = export(saved, tmp_path / "adapter", "--peft")
    assert refused.returncode == 1 and "pass --base-model PATH" in refused.stderr
    assert export(base, tmp_path / "hf_base").returncode == 0
    written = export(saved, tmp_path / "adapter", "--peft", "--base-model", str(tmp_path / "hf_base"))
    assert written.returncode == 0, written.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "hf_base")
    merged = export(saved, tmp_path / "merged", "--dtype", "fp32")
    assert merged.returncode == 0, merged.stderr
    from transformers import AutoModelForCausalLM

    torch.testing.assert_close(hf_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), tokens()),
                               our_logits(saved / "global_step2", tokens()), atol=1e-5, rtol=0)

    # an adapter file that lacks an adapter (written by another program: no manifest) is refused, naming it
    state = load_file_weights_only(saved / "global_step2" / "mp_rank_00_model_states.pt", mmap=False)
    state["module"] = {name: value for name, value in state["module"].items() if not name.endswith("lora_A")}
    torch.save(state, saved / "global_step2" / "mp_rank_00_model_states.pt")
    (saved / "global_step2" / "manifest.json").unlink()
    refused = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, name="damaged.yml", load=str(saved),
                                                             save=str(tmp_path / "resumed2"), train_iters=4,
                                                             **LORA)],
                        expect_success=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and TRAIN_LINE.search(output) is None
    assert f"{saved / 'global_step2' / 'mp_rank_00_model_states.pt'}, of an adapter-only tag over the base" in output
    assert "lacks 16 of the model's trainable parameters" in output and "Traceback" not in output


@pytest.mark.slow
def test_a_full_resume_of_a_checkpoint_without_adapters_into_a_lora_run_is_refused(base, tmp_path):
    result = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, load=str(base), save=str(tmp_path / "out"),
                                                            train_iters=3, **LORA)], expect_success=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "was saved without LoRA adapters (lora_rank 0)" in output and "finetune: true" in output
    assert TRAIN_LINE.search(output) is None


@pytest.mark.slow
def test_an_adapter_only_tag_of_two_ranks_resumes_bit_identically_and_at_another_shape(base, tmp_path):
    two_ranks = {**LORA, "num_gpus": 2, "train_micro_batch_size_per_gpu": 2}
    out = tmp_path / "lora"
    unbroken = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, load=str(base), save=str(out), finetune=True,
                                                              train_iters=4, checkpoint_factor=2, **two_ranks)])
    saved = tmp_path / "copy"
    shutil.copytree(out / "global_step2", saved / "global_step2")
    (saved / "latest").write_text("global_step2")
    after_step_2 = [(line.iteration, line.loss) for line in train_lines(unbroken.stdout) if line.iteration > 2]
    resumed = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, name="resume.yml", load=str(saved),
                                                             save=str(tmp_path / "resumed"), train_iters=4,
                                                             checkpoint_factor=4, **two_ranks)])
    assert [(line.iteration, line.loss) for line in train_lines(resumed.stdout)] == after_step_2

    # one rank at ZeRO-2 (the same global batch): the existing reshard carries the adapters' optimizer over
    one_rank = {**two_ranks, "num_gpus": 1, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}
    reshaped = run_deepy(["configs/tiny.yml", write_overrides(tmp_path, name="reshaped.yml", load=str(saved),
                                                              save=str(tmp_path / "reshaped"), train_iters=4,
                                                              checkpoint_factor=4, **one_rank)])
    assert "LoRA adapters only, over the base" in reshaped.stdout and "note:   full resume at another" in reshaped.stdout
    lines = train_lines(reshaped.stdout)
    assert [line.iteration for line in lines] == [3, 4]
    assert [line.loss for line in lines] == pytest.approx([loss for _, loss in after_step_2], abs=2e-3)


@pytest.mark.distributed
@pytest.mark.usefixtures("single_rank_world")
@pytest.mark.slow
def test_a_tp2_zero3_lora_finetune_of_a_hugging_face_llama_resumes_with_the_same_losses(tmp_path):
    """2 ranks at model_parallel_size 2 under ZeRO-3 (adapters and base partitioned, none kept whole) fine-tune a Llama folder with
    grouped-query attention; the tag at step 2 holds each rank's adapter slices whole, and resumed from it the run
    takes the unbroken run's steps 3 and 4, and its PEFT export gives our logits in PeftModel."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(hf_dir)  # 4096: the embedded corpus's
    run = dict(embedded_corpus=True, seq_length=64, num_gpus=2, model_parallel_size=2, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0},
               optimizer={"type": "Adam", "params": {"lr": 0.01}}, train_iters=4, checkpoint_factor=2, **LORA)
    save = tmp_path / "lora"
    first = run_deepy([write_overrides(tmp_path, load=str(hf_dir), save=str(save), finetune=True, **run)]).stdout
    assert "ZeRO stage 3, 1 data-parallel rank(s) x 2 tensor-parallel" in first
    trained = re.search(r"; ([\d,]+) of them train \(LoRA adapters", first)
    # per rank and layer, times rank 4: A whole on q, k, v, gate and up (64 inputs each), split on o and down (64 / 2
    # and 96 / 2); B split on q, k, v, gate and up (64 / 2, 32 / 2, 32 / 2, 96 / 2 rows), whole on o and down (64)
    per_layer = 4 * (5 * 64 + 32 + 48 + 32 + 16 + 16 + 48 + 48 + 2 * 64)
    assert trained and int(trained[1].replace(",", "")) == 2 * per_layer
    unbroken = train_lines(first)
    tag = save / "global_step2"
    for mp in (0, 1):
        adapters = {name: value for name, value in read_module_weights(tag, mp).items() if ".lora." in name}
        assert adapters and all(value.numel() for value in adapters.values()), f"mp_rank {mp}: empty adapters"
        assert any(value.any() for name, value in adapters.items() if name.endswith("lora_B")), "no adapter trained"

    resumed = run_deepy([write_overrides(tmp_path, name="resume.yml", load=str(save), iteration=2,
                                         save=str(tmp_path / "resumed"), **run)])
    assert [(line.iteration, line.loss) for line in train_lines(resumed.stdout)] == \
        [(line.iteration, line.loss) for line in unbroken[2:]]

    # its PEFT export: PeftModel over the folder the run started from computes our logits
    from peft import PeftModel

    assert export(save, tmp_path / "adapter", "--tag", "global_step2", "--peft").returncode == 0
    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_dir), tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = loaded(input_ids=tokens()).logits
    torch.testing.assert_close(theirs, our_logits(tag, tokens()), atol=1e-5, rtol=0)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_two_stage_lora_finetune_is_the_one_module_run_saves_every_stage_and_resumes(tmp_path):
    """pipe_parallel_size 2 (one Llama layer per stage) against the same fine-tune of a Hugging Face folder without
    a pipeline: the same losses; the adapter-only tag holds every stage's adapters in its layer files, equal to the
    one-module tag's, and so is its PEFT export; a full resume of it takes the unbroken run's steps 3 and 4; a
    layer file that is missing or lacks its adapters is refused, naming the file."""
    hf_dir = save_llama(tmp_path / "hf")
    run = dict(load=str(hf_dir), train_iters=4, checkpoint_factor=2, gradient_accumulation_steps=2,
               train_micro_batch_size_per_gpu=2, **RUN, **PEFT_LORA)  # 2 data-loader workers: they must end
    piped = dict(num_gpus=2, pipe_parallel_size=2)
    one = run_deepy([write_overrides(tmp_path, name="one.yml", save=str(tmp_path / "one"), **run)])
    two = run_deepy([write_overrides(tmp_path, name="two.yml", save=str(tmp_path / "two"), **run, **piped)],
                    timeout=180)
    assert "x 2 pipeline stages" in two.stdout and "of them train (LoRA adapters" in two.stdout
    losses = [(line.iteration, line.loss) for line in train_lines(two.stdout)]
    assert losses == [(line.iteration, line.loss) for line in train_lines(one.stdout)]

    tag = tmp_path / "two" / "global_step2"
    for position in (2, 3):  # each stage's transformer layer: its adapters alone
        layer = load_file_weights_only(tag / layout.layer_file_name(position, 0), mmap=False)
        assert len(layer) == 14 and all(".lora." in name for name in layer), f"layer {position}: {sorted(layer)}"
    adapters, unpiped = read_module_weights(tag), read_module_weights(tmp_path / "one" / "global_step2")
    assert adapters.keys() == unpiped.keys() and all(torch.equal(adapters[k], unpiped[k]) for k in unpiped)
    for name in ("one", "two"):
        convert_neox_to_hf(tmp_path / name, tmp_path / f"peft-{name}", tag="global_step2", peft=True)
    exported = [load_file(tmp_path / f"peft-{name}" / ADAPTER_WEIGHTS_NAME) for name in ("one", "two")]
    assert len(exported[0]) == 28 and exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][key], exported[1][key]) for key in exported[0])
    configs = [json.loads((tmp_path / f"peft-{name}" / ADAPTER_CONFIG_NAME).read_text()) for name in ("one", "two")]
    assert configs[0] == configs[1] and configs[1]["base_model_name_or_path"] == str(hf_dir)

    resume = {**run, "finetune": False, "load": str(tmp_path / "two"), "iteration": 2}
    resumed = run_deepy([write_overrides(tmp_path, name="resume.yml", save=str(tmp_path / "resumed"), **resume,
                                         **piped)])
    assert f"LoRA adapters only, over the base {hf_dir}" in resumed.stdout
    assert [(line.iteration, line.loss) for line in train_lines(resumed.stdout)] == losses[2:]

    # written by another program (no manifest): stage 1's layer without its As; stage 0's empty embedding file gone
    damaged = tmp_path / "damaged" / "global_step2"
    shutil.copytree(tag, damaged)
    (damaged / "manifest.json").unlink()
    layer_3 = damaged / layout.layer_file_name(3, 0)
    torch.save({name: value for name, value in load_file_weights_only(layer_3, mmap=False).items()
                if not name.endswith("lora_A")}, layer_3)
    lacking = _refused(tmp_path, "lacking.yml", resume, piped, damaged)
    assert f"{layer_3}, of an adapter-only tag over the base {hf_dir}, lacks 7 of the model's trainable" in lacking
    shutil.copy(tag / layout.layer_file_name(3, 0), layer_3)
    (damaged / layout.layer_file_name(0, 0)).unlink()
    missing = _refused(tmp_path, "missing.yml", resume, piped, damaged)
    assert f"{damaged / layout.layer_file_name(0, 0)} is missing from {damaged}: DeepSpeed's pipe engine" in missing


def _refused(tmp_path, name: str, resume: dict, piped: dict, tag_dir) -> str:
    """The output of a resume of ``tag_dir`` that stops before its first step without a traceback."""
    result = run_deepy([write_overrides(tmp_path, name=name, save=str(tmp_path / "refused"),
                                        **{**resume, "load": str(tag_dir.parent)}, **piped)], expect_success=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and TRAIN_LINE.search(output) is None and "Traceback" not in output, output[-3000:]
    return output
