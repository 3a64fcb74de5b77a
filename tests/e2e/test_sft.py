"""End to end, as a GPT-NeoX user runs SFT: chats through the preprocess tool, a fine-tune of a Hugging Face
Llama folder on 2 ranks (bf16, ZeRO-1) with label files and unpacked samples (the settings of GPT-NeoX's
llama3-8b-sft.yml, scaled down)."""

from __future__ import annotations

import json

import pytest

from megatron.hf.convert import convert_neox_to_hf
from tests.deepy_runs import run_deepy, tensorboard_scalars, train_lines, write_overrides
from tests.e2e.test_preprocess_chat import CHAT, make_chat_tokenizer, run, write_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_sft_from_a_hugging_face_llama_on_two_ranks(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_chat_tokenizer(tmp_path / "tok", eos="<|endoftext|>")
    chats = [{"messages": CHAT[: 3 + (i % 3)]} for i in range(40)]
    run("--input", write_jsonl(tmp_path / "chats.jsonl", chats), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "messages", "--output-prefix", str(tmp_path / "sft"))
    hf_dir = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(hf_dir)
    tokens, labels = str(tmp_path / "sft_messages_document"), str(tmp_path / "sft_messages_label_document")
    finetune = write_overrides(
        tmp_path, name="sft.yml", load=str(hf_dir), finetune=True, save=str(tmp_path / "run"),
        tensorboard_dir=str(tmp_path / "tb"), tokenizer_type="HFTokenizer", vocab_file=str(tokenizer / "tokenizer.json"),
        seq_length=24, train_data_paths=[tokens], train_label_data_paths=[labels], valid_data_paths=[tokens],
        valid_label_data_paths=[labels], pack_impl="unpacked", allow_chopped=False, num_gpus=2,
        train_micro_batch_size_per_gpu=2, precision="bf16", bf16={"enabled": True}, zero_optimization={"stage": 1},
        optimizer={"type": "Adam", "params": {"lr": 0.001}}, train_iters=2, eval_interval=2, eval_iters=1,
        num_workers=0, no_save_optim=True)
    result = run_deepy([finetune])
    assert f"model settings taken from {hf_dir / 'config.json'}" in result.stdout
    assert "checkpoint load plan: finetune" in result.stdout
    assert [line.iteration for line in train_lines(result.stdout)] == [1, 2]
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert set(scalars["valid/loss"]) == {2} and (tmp_path / "run" / "global_step2").is_dir()

    # no_save_optim: a weights-only tag, every file of it in the manifest, exported as any tag is.
    tag_dir = tmp_path / "run" / "global_step2"
    written = sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*") if p.is_file())
    assert not any("optim_states" in name for name in written), written
    assert sorted(json.loads((tag_dir / "manifest.json").read_text())["files"]) == \
        [name for name in written if name != "manifest.json"]
    convert_neox_to_hf(tmp_path / "run", tmp_path / "export")
    exported, loading = LlamaForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not any(loading.values()), loading
    assert sorted(exported.state_dict()) == sorted(LlamaForCausalLM.from_pretrained(hf_dir).state_dict())
