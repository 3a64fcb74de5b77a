"""generate.py's generation: greedy output equals transformers' `generate` token for token, for both
families, with and without the key/value cache, loaded through the trainer's load plan; GPT-NeoX's
settings and output format."""

from __future__ import annotations

import json

import pytest
import torch

from megatron.generation import Limits, Sampling, complete, generate_samples, next_tokens
from megatron.logging import get_logger
from megatron.training.loop import setup_for_inference
from tests.e2e.test_hf_conversion import TEXT, make_hf_model, our_args, save_hf

pytestmark = pytest.mark.usefixtures("single_rank_world")

PROMPTS = [[5, 17, 3], [200, 11, 42, 42, 9, 1, 77]]
NEW_TOKENS = 24


def hf_greedy(model, prompt: list[int], new_tokens: int, eod: int) -> tuple[list[int], bool]:
    """transformers' greedy continuation, cut where it generated `eod` (GPT-NeoX leaves it out)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eod,
                         pad_token_id=eod, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tokens = out[0, len(prompt):].tolist()
    return (tokens[:tokens.index(eod)], True) if eod in tokens else (tokens, False)


def loaded(hf_dir, load=None, **settings):
    args = our_args(hf_dir, load=str(load or hf_dir), finetune=True, seq_length=64, **settings)
    return setup_for_inference(args).module


@pytest.mark.parametrize("kind, source", [("neox_parallel", "hf_folder"), ("llama_gqa", "our_checkpoint"),
                                          ("neox_parallel", "pipeline_layer_files")])
def test_greedy_generation_equals_transformers_generate(kind, source, tmp_path):
    """Loaded from the HF folder itself, from a checkpoint of ours (DeepSpeed's files) converted from it, or
    from GPT-NeoX's layer files of a 2-stage pipeline converted from it."""
    from megatron.hf.convert import convert_hf_to_neox

    hf = make_hf_model(kind)
    hf_dir = save_hf(hf, tmp_path / "hf")
    stages = {"our_checkpoint": 0, "pipeline_layer_files": 2}
    load = (convert_hf_to_neox(hf_dir, tmp_path / "ckpt", pipe_parallel_size=stages[source]).tag_dir.parent
            if source in stages else None)
    ours = loaded(hf_dir, load)
    # the end-of-document token: one transformers generates for the first prompt, so the stop is exercised too
    eod = hf_greedy(hf, PROMPTS[0], NEW_TOKENS, eod=-1)[0][NEW_TOKENS // 2]
    stopped = 0
    for prompt in PROMPTS:
        expected, finished = hf_greedy(hf, prompt, NEW_TOKENS, eod)
        stopped += finished
        for recompute in (False, True):
            got = complete(ours, prompt, Limits(64, NEW_TOKENS, eod), Sampling(), recompute=recompute)
            assert (got.tokens, got.finished) == (expected, finished), f"recompute={recompute}"
    assert stopped >= 1 and len(expected) > 3


def model_of_tokenizer_size(kind: str, tmp_path):
    """A tiny transformers model whose vocabulary is the test tokenizer's: every token it generates has a text."""
    from megatron.tokenizer import HFTokenizer, train_bpe_tokenizer

    size = HFTokenizer(train_bpe_tokenizer(TEXT, tmp_path / "tokenizer.json", vocab_size=300, min_frequency=1)).vocab_size
    hf = make_hf_model(kind)
    hf.resize_token_embeddings(size)
    return hf


def test_input_file_samples_are_written_as_gpt_neox_writes_them(tmp_path):
    """One JSON object a line: the stripped prompt, transformers' greedy completion as text, its length."""
    from transformers import PreTrainedTokenizerFast

    from megatron.tokenizer import build_tokenizer

    hf = model_of_tokenizer_size("llama_gqa", tmp_path)
    hf_dir = save_hf(hf, tmp_path / "hf", tokenizer=True)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("  the quick brown fox\n\n\na stitch in time \n")
    args = our_args(hf_dir, load=str(hf_dir), finetune=True, seq_length=64, tokenizer_type="HFTokenizer",
                    vocab_file=str(hf_dir / "tokenizer.json"), text_gen_type="input-file", maximum_tokens=10,
                    sample_input_file=str(prompts), sample_output_file=str(tmp_path / "out" / "samples.jsonl"))
    model = setup_for_inference(args).module
    records = generate_samples(model, build_tokenizer(args), args, rank=0, log=get_logger())

    written = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert written == records
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    assert [record["context"] for record in written] == ["the quick brown fox", "a stitch in time"]
    for record in written:
        expected, finished = hf_greedy(hf, hf_tokenizer.encode(record["context"]), 10, eod=0)
        assert record["text"] == hf_tokenizer.decode(expected)
        assert (record["length"], record["finished"], record["message"]) == (len(expected), finished, None)
        assert record["duration_seconds"] > 0


def test_unconditional_samples_start_from_the_end_of_document_token(tmp_path):
    hf = model_of_tokenizer_size("neox_parallel", tmp_path)
    hf_dir = save_hf(hf, tmp_path / "hf", tokenizer=True)
    args = our_args(hf_dir, load=str(hf_dir), finetune=True, seq_length=64, tokenizer_type="HFTokenizer",
                    vocab_file=str(hf_dir / "tokenizer.json"), text_gen_type="unconditional", num_samples=2,
                    maximum_tokens=6, temperature=0.0, sample_output_file=str(tmp_path / "samples.txt"))
    from megatron.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(args)
    records = generate_samples(setup_for_inference(args).module, tokenizer, args, rank=0, log=get_logger())
    expected, _ = hf_greedy(hf, [tokenizer.eod], 6, eod=tokenizer.eod)
    assert len(records) == 2 and all(record["context"] == "" for record in records)
    assert all(record["length"] == len(expected) for record in records)
    assert len((tmp_path / "samples.txt").read_text().splitlines()) == 2


def test_a_prompt_filling_seq_length_gets_a_message_not_a_completion(tmp_path):
    hf_dir = save_hf(make_hf_model("llama_gqa"), tmp_path / "hf", tokenizer=True)
    args = our_args(hf_dir, load=str(hf_dir), finetune=True, seq_length=8, tokenizer_type="HFTokenizer",
                    vocab_file=str(hf_dir / "tokenizer.json"), text_gen_type="unconditional")
    from megatron.generation.samples import GenerationSettings, sample
    from megatron.tokenizer import build_tokenizer

    record = sample(setup_for_inference(args).module, build_tokenizer(args), GenerationSettings.from_args(args),
                    " ".join(TEXT[:4]))
    assert record["text"] is None and record["length"] == 0
    assert "leaves no room within seq_length=8" in record["message"]


def test_sampling_keeps_gpt_neox_meaning_of_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = lambda sampling: {next_tokens(logits, sampling, torch.Generator().manual_seed(s)).item()  # noqa: E731
                              for s in range(200)}
    assert draws(Sampling()) == {0}  # all 0: greedy
    assert draws(Sampling(temperature=1.0, top_k=2)) == {0, 1}
    # top_p 0.6: 0.5 alone does not pass it, so the second token stays; the third does not
    assert draws(Sampling(temperature=1.0, top_p=0.6)) == {0, 1}
    assert draws(Sampling(temperature=1.0, top_p=0.4)) == {0}
    assert draws(Sampling(temperature=1.0)) == {0, 1, 2, 3}
    assert len(draws(Sampling(temperature=1.0, top_k=3))) == 3


@pytest.mark.parametrize("change, expected", [
    ({"text_gen_type": None}, "text_gen_type: not set"),
    ({"load": None}, "load: not set"),
    ({"text_gen_type": "input-file"}, "sample_input_file: not set"),
    ({"text_gen_type": "input-file", "sample_input_file": "/nonexistent/prompts.txt"}, "is not a file"),
])
def test_settings_generate_py_cannot_use_are_one_line_errors(change, expected):
    from megatron.generation import GenerationError, check_generation_settings
    from megatron.neox_arguments import NeoXArgs

    settings = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 8, "load": "/ckpt",
                "text_gen_type": "unconditional", **change}
    with pytest.raises(GenerationError, match=expected):
        check_generation_settings(NeoXArgs.from_dict({k: v for k, v in settings.items() if v is not None}))


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.distributed
def test_deepy_generate_py_at_tensor_parallel_2_completes_as_transformers_does(tmp_path):
    """The user's command: deepy.py generate.py with a config naming only the checkpoint (an HF folder, its
    shape from config.json) and text_generation.yml's settings, on 2 ranks splitting the model; one key/value
    head, so both ranks hold it."""
    from transformers import PreTrainedTokenizerFast

    from tests.deepy_runs import run_deepy, write_overrides

    hf = model_of_tokenizer_size("llama_mqa", tmp_path)
    hf_dir = save_hf(hf, tmp_path / "hf", tokenizer=True)
    (tmp_path / "prompts.txt").write_text("the quick brown fox\na stitch in time\n")
    overrides = write_overrides(tmp_path, load=str(hf_dir), num_gpus=2, model_parallel_size=2, seq_length=64,
                                text_gen_type="input-file", temperature=0.0, maximum_tokens=12,
                                sample_input_file=str(tmp_path / "prompts.txt"),
                                sample_output_file=str(tmp_path / "samples.jsonl"))
    result = run_deepy(["configs/text_generation.yml", overrides], script="generate.py")
    assert "1 data-parallel rank(s) x 2 tensor-parallel" in result.stdout

    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    written = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [record["context"] for record in written] == ["the quick brown fox", "a stitch in time"]
    for record in written:
        expected, _ = hf_greedy(hf, hf_tokenizer.encode(record["context"]), 12, eod=0)
        assert record["text"] == hf_tokenizer.decode(expected)


def test_interactive_reads_prompts_until_the_input_ends_and_prints_each_completion(tmp_path, monkeypatch, capsys):
    import io

    from transformers import PreTrainedTokenizerFast

    from megatron.tokenizer import build_tokenizer

    hf = model_of_tokenizer_size("llama_gqa", tmp_path)
    hf_dir = save_hf(hf, tmp_path / "hf", tokenizer=True)
    args = our_args(hf_dir, load=str(hf_dir), finetune=True, seq_length=64, tokenizer_type="HFTokenizer",
                    vocab_file=str(hf_dir / "tokenizer.json"), text_gen_type="interactive", maximum_tokens=5,
                    prompt_end="###")
    monkeypatch.setattr("sys.stdin", io.StringIO("the quick\nbrown fox ###\na stitch###\n"))
    records = generate_samples(setup_for_inference(args).module, build_tokenizer(args), args, rank=0, log=get_logger())
    assert records == []
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    printed = [line.split("Generated Text: ", 1)[1] for line in capsys.readouterr().out.splitlines()
               if "Generated Text: " in line]
    expected = [hf_tokenizer.decode(hf_greedy(hf, hf_tokenizer.encode(prompt), 5, eod=0)[0])
                for prompt in ("the quick\nbrown fox ", "a stitch")]
    assert printed == expected


def test_training_with_only_generation_settings_is_a_one_line_error(tmp_path):
    """Files setting text_gen_type need no train_iters (they are for generate.py); train.py still asks for it."""
    from megatron.neox_arguments import ConfigError, NeoXArgs
    from megatron.training.loop import setup
    from tests.unit.test_neox_args import write_yaml

    config = write_yaml(tmp_path, "gen.yml", {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                              "seq_length": 32, "load": "/ckpt", "text_gen_type": "unconditional"})
    args = NeoXArgs.from_yaml_files([config])
    assert args.train_iters is None
    with pytest.raises(ConfigError, match="train_iters: required but not set"):
        setup(args)


@pytest.mark.parametrize("settings", [
    {"pos_emb": "learned"},
    {"pos_emb": "rotary", "sliding_window_width": 3, "num_kv_heads": 2},
], ids=["learned_positions", "sliding_window_gqa"])
def test_each_cached_step_gives_the_logits_of_the_whole_sequence(settings):
    """The options transformers' families above do not have: the cache's positions and masks agree with
    the training forward (no cache) step by step."""
    from megatron.model import KVCache, build_model
    from tests.unit.test_model import randomize_, tiny_args, tokens

    model = build_model(tiny_args(**settings).architecture(), seed=3)
    randomize_(model)
    model.eval()
    sequence = tokens(batch=1, seq=12, seed=4).to(next(model.parameters()).device)
    cache = KVCache(model.arch.num_layers)
    with torch.no_grad():
        for end in (5, *range(6, 13)):  # a 5-token prompt, then one token at a time
            cached = model(sequence[:, cache.length:end], kv_cache=cache)[:, -1]
            torch.testing.assert_close(cached, model(sequence[:, :end])[:, -1], rtol=1e-5, atol=1e-5)
