"""Long-context fine-tunes from Hugging Face folders: a Llama 3.1-style folder (llama3 RoPE scaling) and a Qwen2
folder (yarn) trained at 8,192 tokens with the sequence split over 2 context-parallel ranks take the first step
transformers computes on the same tokens; a sequence longer than the folder's max_position_embeddings is refused
in one line before any rank starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.data import MMapIndexedDatasetBuilder
from tests.deepy_runs import run_deepy, tensorboard_scalars, write_overrides
from tests.e2e.test_preprocess_chat import make_chat_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

SEQ = 8192
VOCAB = 64  # at least the test tokenizer's words
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=SEQ, tie_word_embeddings=False)
# Each scales the frequencies of a model trained on shorter sequences (original_max_position_embeddings) to SEQ
FAMILIES = {
    "llama-3.1-rope": ("LlamaConfig", "LlamaForCausalLM",
                       {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": SEQ // 8, "rope_theta": 500000.0}),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM",
                   {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": SEQ // 4,
                    "rope_theta": 1000000.0}),
}


def hf_folder(directory, family: str):
    import transformers

    config_class, model_class, rope = FAMILIES[family]
    config = getattr(transformers, config_class)(**SHAPE, rope_parameters=rope)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    # Wide queries and keys make attention sharp, so the loss depends on the positions: at transformers' init it
    # is nearly uniform and the loss moves by 3e-6 without the scaling; here by 1e-3, and by 1e-4 with twice the
    # factor, both far outside the comparison's 1e-5.
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 1.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.3)
    model.save_pretrained(directory)
    return model


def one_document(prefix, tokens: np.ndarray) -> str:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    builder.add_item(tokens)
    builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_long_context_folder_at_context_parallel_2_takes_transformers_first_step(tmp_path, family):
    model = hf_folder(tmp_path / "hf", family)
    tokenizer = make_chat_tokenizer(tmp_path / "tok")
    # one document of exactly one sample (SEQ + 1 tokens): the run's first batch is known
    tokens = np.random.default_rng(0).integers(0, 19, size=SEQ + 1)
    data = one_document(tmp_path / "long", tokens)
    overrides = write_overrides(
        tmp_path, load=str(tmp_path / "hf"), finetune=True, tokenizer_type="HFTokenizer",
        vocab_file=str(tokenizer / "tokenizer.json"), train_data_paths=[data], valid_data_paths=[data],
        seq_length=SEQ, train_micro_batch_size_per_gpu=1, num_gpus=2, context_parallel_size=2, precision="fp32",
        zero_optimization={"stage": 1}, optimizer={"type": "Adam", "params": {"lr": 1e-4}}, train_iters=1,
        eval_interval=1000, log_interval=1, num_workers=0, tensorboard_dir=str(tmp_path / "tb"))
    result = run_deepy([overrides])
    assert "2 context-parallel" in result.stdout
    ours = tensorboard_scalars(tmp_path / "tb")["train/loss"][1]

    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits.float()
    expected = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item()
    assert ours == pytest.approx(expected, rel=1e-5)


def test_a_sequence_longer_than_the_folder_s_positions_is_one_line_at_the_dry_run(tmp_path):
    hf_folder(tmp_path / "hf", "llama-3.1-rope")
    overrides = write_overrides(tmp_path, load=str(tmp_path / "hf"), finetune=True, embedded_corpus=True,
                                seq_length=2 * SEQ, num_gpus=2, context_parallel_size=2, train_iters=1)
    result = run_deepy([overrides], "--dry-run", expect_success=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert "max_position_embeddings" in lines[-1] and str(2 * SEQ) in lines[-1], result.stderr
    assert "Traceback" not in result.stderr
