"""End to end, as a GPT-NeoX user trains a reward model (GPT-NeoX's llama3-8b-rm.yml, scaled down): chosen and
rejected chats through the preprocess tool with --for-rm, a fine-tune of a Hugging Face Llama causal LM on
2 ranks with micro batch 1 (where GPT-NeoX crashes), a fresh scalar head, then the export to a
LlamaForSequenceClassification folder whose scores are the model's rewards."""

from __future__ import annotations

import pytest
import torch

from megatron.checkpointing.ondisk.module_weights import read_module_weights
from megatron.data import MMapIndexedDataset
from megatron.hf.convert import convert_neox_to_hf
from megatron.hf.errors import HFConversionError
from megatron.model import build_model
from megatron.neox_arguments import NeoXArgs
from tests.deepy_runs import run_deepy, tensorboard_scalars, write_overrides
from tests.e2e.test_preprocess_chat import make_chat_tokenizer, run, write_jsonl
from tests.unit.test_data_pairwise import CHOSEN, PROMPTS, REJECTED, chat

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("single_rank_world")]

LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def test_reward_model_from_a_hugging_face_llama_on_two_ranks_exported_as_a_sequence_classifier(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = make_chat_tokenizer(tmp_path / "tok", eos="<|endoftext|>")
    records = [{"chosen": chat(p, c), "rejected": chat(p, r)}
               for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)] * 3
    run("--input", write_jsonl(tmp_path / "pairs.jsonl", records), "--tokenizer-path", str(tokenizer),
        "--jsonl-keys", "chosen", "rejected", "--for-rm", "--output-prefix", str(tmp_path / "rm"))
    hf_dir = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(hf_dir)
    paths = {f"{sign}_{split}_{kind}data_paths": [str(tmp_path / f"rm_{key}_{kind}document")]
             for split in ("train", "valid") for sign, key in (("pos", "chosen"), ("neg", "rejected"))
             for kind in ("", "label_")}
    config = write_overrides(
        tmp_path, name="rm.yml", load=str(hf_dir), finetune=True, save=str(tmp_path / "run"),
        tensorboard_dir=str(tmp_path / "tb"), tokenizer_type="HFTokenizer", vocab_file=str(tokenizer / "tokenizer.json"),
        seq_length=24, train_impl="rm", dataset_impl="pairwise", pack_impl="unpacked", allow_chopped=False,
        no_weight_tying=True, z_loss=0.01, num_gpus=2, train_micro_batch_size_per_gpu=1, precision="fp32",
        zero_optimization={"stage": 1}, optimizer={"type": "Adam", "params": {"lr": 0.001}}, train_iters=3,
        eval_interval=3, eval_iters=1, num_workers=0, **paths)
    result = run_deepy([config])
    assert "reward head rm_linear (drawn from the seed; the source is a language model" in result.stdout
    lines = [line for line in result.stdout.splitlines() if "iteration" in line and "| loss" in line]
    assert len(lines) == 3 and all("| accuracy" in line and "| margin" in line for line in lines), lines
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert set(scalars["train/accuracy"]) == {1, 2, 3} and set(scalars["valid/margin"]) == {3}

    tag_dir = tmp_path / "run" / "global_step3"
    saved = read_module_weights(tag_dir)
    assert "sequential.6.rm_linear.weight" in saved and not any("final_linear" in name for name in saved)
    with pytest.raises(HFConversionError, match="padding token other than eos"):
        convert_neox_to_hf(tmp_path / "run", tmp_path / "no_pad")
    pad = int(tokenizer_pad_id(tokenizer))
    convert_neox_to_hf(tmp_path / "run", tmp_path / "export", pad_token_id=pad)
    hf, loading = LlamaForSequenceClassification.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not any(loading.values()), loading

    settings = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_kv_heads": 2,
                "intermediate_size": 3 * 64, "pos_emb": "rotary", "rotary_pct": 1.0, "rotary_emb_base": 10000,
                "norm": "rmsnorm", "rms_norm_epsilon": 1e-6, "activation": "swiglu", "gpt_j_residual": False,
                "use_bias_in_norms": False, "use_bias_in_attn_linear": False, "use_bias_in_mlp": False,
                "seq_length": 64, "padded_vocab_size": 128, "train_impl": "rm", "dataset_impl": "pairwise",
                "pack_impl": "unpacked", "no_weight_tying": True}
    ours = rewards_of_checkpoint(settings, saved, tmp_path / "rm_chosen_document")
    chats = MMapIndexedDataset(tmp_path / "rm_chosen_document")
    # transformers: the chat + ONE eos, right-padded; its score is read at the last token that is not padding
    width = max(len(chats[i]) - 1 for i in range(4))
    inputs = torch.tensor([(chats[i][:-1].tolist() + [pad] * width)[:width] for i in range(4)])
    with torch.no_grad():
        scores = hf.eval()(input_ids=inputs).logits[:, 0]
    torch.testing.assert_close(scores, ours, atol=1e-5, rtol=1e-4)


def tokenizer_pad_id(folder) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).pad_token_id


def rewards_of_checkpoint(settings: dict, weights: dict, prefix) -> torch.Tensor:
    """Our model's reward of the first 4 chats of `prefix`: its value at the first of the two appended eos."""
    model = build_model(NeoXArgs.from_dict(settings).architecture(), seed=1)
    model.load_state_dict(weights, strict=True)
    data = MMapIndexedDataset(prefix)
    with torch.no_grad():
        return torch.stack([model.eval()(torch.tensor(data[i].tolist()).unsqueeze(0))[0, len(data[i]) - 2, 0]
                            for i in range(4)])
