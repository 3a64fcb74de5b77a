"""eval.py on the LM Evaluation Harness: a small local task (its YAML files and data written here, nothing
downloaded) scored through our engine gives the scores the Hugging Face model gives on the same weights,
computed here with transformers; GPT-NeoX's command line and results file."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

pytest.importorskip("lm_eval")

from megatron.logging import get_logger  # noqa: E402
from megatron.training.loop import setup_for_inference  # noqa: E402
from tests.e2e.test_generate import hf_greedy, model_of_tokenizer_size  # noqa: E402
from tests.e2e.test_hf_conversion import our_args, save_hf  # noqa: E402

# the word's space belongs to the continuation, as the harness's tasks write them
CONTINUATIONS = [("the quick brown", " fox jumps over"), ("a stitch in", " time saves nine"), ("hello", " world"),
                 ("the lazy", " dog saves the quick fox")]
TEXTS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
         "hello world hello fox"]
PROMPTS = ["the quick brown", "a stitch"]
GEN_TOKENS = 6
RESULTS_FILE = re.compile(r"tiny_eval_results_\d\d-\d\d-\d{4}-\d\d-\d\d-\d\d\.json")
TASKS = ["tiny_continuations", "tiny_texts", "tiny_completions"]


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """The harness reads the datasets of the local task; it must not try the hub."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))


def hf_tokenizer_of(hf_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))


def write_task_files(directory, hf, tokenizer) -> None:
    """Three local tasks, one of each request type; the completion targets are transformers' greedy ones."""
    directory.mkdir(parents=True)
    eod = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    targets = [tokenizer.decode(hf_greedy(hf, tokenizer.encode(p), GEN_TOKENS, eod)[0]).split("\n")[0]
               for p in PROMPTS]
    rows = {"continuations": [{"context": c, "continuation": t} for c, t in CONTINUATIONS],
            "texts": [{"text": t} for t in TEXTS],
            "completions": [{"prompt": p, "target": t} for p, t in zip(PROMPTS, targets, strict=True)]}
    for name, records in rows.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def task(name, **config):
        data = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(directory / f"{name}.jsonl")}},
                "test_split": "test"}
        (directory / f"tiny_{name}.yaml").write_text(json.dumps({"task": f"tiny_{name}", **data, **config}))

    task("continuations", output_type="loglikelihood", doc_to_text="{{context}}", doc_to_target="{{continuation}}",
         metric_list=[{"metric": "perplexity"}, {"metric": "acc"}])
    task("texts", output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
         metric_list=[{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}])
    task("completions", output_type="generate_until", doc_to_text="{{prompt}}", doc_to_target="{{target}}",
         generation_kwargs={"until": ["\n"], "max_gen_toks": GEN_TOKENS, "do_sample": False},
         metric_list=[{"metric": "exact_match"}])


@torch.no_grad()
def hf_log_probs(hf, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1, by transformers."""
    logits = hf(torch.tensor([tokens[:-1]])).logits[0].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)


def hf_scores(hf, tokenizer) -> dict[str, dict[str, float]]:
    """The metrics of the three tasks, from transformers' log-probabilities (the harness's definitions:
    the continuation's tokens are the whole text's after the context's; a text is scored after an eod)."""
    eod = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    log_likelihoods, greedy = [], []
    for context, target in CONTINUATIONS:
        whole, start = tokenizer.encode(context + target), len(tokenizer.encode(context))
        log_likelihoods.append(float(hf_log_probs(hf, whole)[start - 1:].sum()))
        logits = hf(torch.tensor([whole[:-1]])).logits[0, start - 1:]
        greedy.append(bool((logits.argmax(-1) == torch.tensor(whole[start:])).all()))
    rolling = [float(hf_log_probs(hf, [eod, *tokenizer.encode(text)]).sum()) for text in TEXTS]
    words = sum(len(re.split(r"\s+", text)) for text in TEXTS)
    text_bytes = sum(len(text.encode()) for text in TEXTS)
    return {"tiny_continuations": {"perplexity,none": math.exp(-sum(log_likelihoods) / len(log_likelihoods)),
                                   "acc,none": sum(greedy) / len(greedy)},
            "tiny_texts": {"word_perplexity,none": math.exp(-sum(rolling) / words),
                           "bits_per_byte,none": -sum(rolling) / text_bytes / math.log(2)},
            "tiny_completions": {"exact_match,none": 1.0}}


def assert_scores_equal(results: dict, expected: dict[str, dict[str, float]]) -> None:
    for task, metrics in expected.items():
        for metric, value in metrics.items():
            assert results["results"][task][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, metric)


def eval_settings(hf_dir, tasks_dir, **settings):
    return dict(tokenizer_type="HFTokenizer", vocab_file=str(hf_dir / "tokenizer.json"),
                eval_include_path=str(tasks_dir), eval_bootstrap_iters=0, seq_length=64, **settings)


@pytest.mark.usefixtures("single_rank_world")
def test_the_harness_scores_a_gpt_neox_model_as_transformers_does(tmp_path):
    """In-process, from the Hugging Face folder: loglikelihood, rolling and generation requests."""
    from megatron.evaluation import evaluate
    from megatron.tokenizer import build_tokenizer

    hf = model_of_tokenizer_size("neox_parallel", tmp_path)
    hf_dir = save_hf(hf, tmp_path / "hf", tokenizer=True)
    tokenizer = hf_tokenizer_of(hf_dir)
    write_task_files(tmp_path / "tasks", hf, tokenizer)
    args = our_args(hf_dir, load=str(hf_dir), finetune=True, eval_tasks=TASKS,
                    train_micro_batch_size_per_gpu=3, **eval_settings(hf_dir, tmp_path / "tasks"))
    model = setup_for_inference(args).module
    results = evaluate(model, build_tokenizer(args), args)
    assert sorted(results["results"]) == sorted(TASKS)
    assert_scores_equal(results, hf_scores(hf, tokenizer))
    get_logger().info(f"scores: {results['results']}")

    # request by request, in the harness's order (the batches run longest first)
    from lm_eval.api.instance import Instance

    from megatron.evaluation.harness_model import NeoXLanguageModel

    language_model = NeoXLanguageModel(model, build_tokenizer(args), max_length=64, batch_size=3)
    requests = [Instance("loglikelihood", doc={}, arguments=pair, idx=0) for pair in CONTINUATIONS]
    expected = [float(hf_log_probs(hf, tokenizer.encode(c + t))[len(tokenizer.encode(c)) - 1:].sum())
                for c, t in CONTINUATIONS]
    got = [log_likelihood for log_likelihood, _ in language_model.loglikelihood(requests)]
    assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.parametrize("kind, model_parallel_size", [("llama_gqa", 1), ("neox_parallel", 2)],
                         ids=["data_parallel_2", "tensor_parallel_2"])
def test_deepy_eval_py_writes_gpt_neox_results_file_with_transformers_scores(kind, model_parallel_size, tmp_path):
    """The user's command on 2 ranks, on a checkpoint of ours (converted from transformers at tensor-parallel
    size 1): the tasks from --eval_tasks, split between 2 data-parallel ranks or run by 2 tensor-parallel ranks
    together; one results file, named and laid out as GPT-NeoX writes it, with transformers' scores."""
    from megatron.hf.convert import convert_hf_to_neox
    from tests.deepy_runs import run_deepy, write_overrides

    hf = model_of_tokenizer_size(kind, tmp_path)
    hf_dir = save_hf(hf, tmp_path / "hf", tokenizer=True)
    tokenizer = hf_tokenizer_of(hf_dir)
    write_task_files(tmp_path / "tasks", hf, tokenizer)
    checkpoint = convert_hf_to_neox(hf_dir, tmp_path / "ckpt").tag_dir.parent
    prefix = tmp_path / "out" / "tiny"
    # the checkpoint's 300 vocabulary rows, split in 2 (the load plan says so when not set)
    padding = {"make_vocab_size_divisible_by": 150} if model_parallel_size == 2 else {}
    overrides = write_overrides(tmp_path, load=str(checkpoint), eval_results_prefix=str(prefix), num_gpus=2,
                                model_parallel_size=model_parallel_size, **padding,
                                **eval_settings(hf_dir, tmp_path / "tasks"))
    result = run_deepy([overrides], "--eval_tasks", *TASKS, script="eval.py")
    assert f"{2 // model_parallel_size} data-parallel rank(s) x {model_parallel_size} tensor-parallel" in result.stdout

    written = list((tmp_path / "out").iterdir())
    assert len(written) == 1 and RESULTS_FILE.fullmatch(written[0].name), written
    results = json.loads(written[0].read_text())
    assert {"results", "configs", "versions", "n-shot", "config", "git_hash"} <= set(results)
    assert results["config"]["model"] == "neox" and results["config"]["model_args"]["load"] == str(checkpoint)
    assert all("alias" not in metrics for metrics in results["results"].values())
    assert_scores_equal(results, hf_scores(hf, tokenizer))
    assert "tiny_texts" in result.stdout  # the harness's table


EVAL_ONLY = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 8, "load": "/ckpt",
             "eval_tasks": ["lambada_openai"]}


@pytest.mark.parametrize("change, expected", [
    ({"eval_tasks": None}, "eval_tasks: not set"),
    ({"eval_tasks": []}, "eval_tasks: not set"),
    ({"load": None}, "load: not set"),
    ({"eval_include_path": "/nonexistent/tasks"}, "eval_include_path: '/nonexistent/tasks' is not a directory"),
    ({"eval_num_fewshot": -1}, "eval_num_fewshot: -1 is negative"),
])
def test_settings_eval_py_cannot_use_are_one_line_errors(change, expected):
    from megatron.evaluation import EvaluationError, check_evaluation_settings
    from megatron.neox_arguments import NeoXArgs

    settings = {k: v for k, v in {**EVAL_ONLY, **change}.items() if v is not None}
    with pytest.raises(EvaluationError, match=re.escape(expected)):
        check_evaluation_settings(NeoXArgs.from_dict(settings))


def test_without_the_harness_eval_py_says_how_to_install_it(monkeypatch):
    import sys

    from megatron.evaluation import EvaluationError, check_evaluation_settings
    from megatron.neox_arguments import NeoXArgs

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError, as when not installed
    with pytest.raises(EvaluationError, match=re.escape("not installed: pip install -e '.[eval]'")):
        check_evaluation_settings(NeoXArgs.from_dict(EVAL_ONLY))


def test_eval_tasks_are_matched_as_gpt_neox_matches_them():
    from megatron.evaluation import EvaluationError
    from megatron.evaluation.eval_run import task_names

    known = ["hellaswag", "lambada_openai", "lambada_standard", "piqa"]
    assert task_names(["piqa", "lambada_*", "lambada_openai"], known) == ["piqa", "lambada_openai", "lambada_standard"]
    with pytest.raises(EvaluationError, match="the harness has no task 'lambda'"):
        task_names(["piqa", "lambda"], known)


def test_deepy_eval_tasks_flag_overrides_the_files_and_needs_no_training_settings(tmp_path, capsys):
    """GPT-NeoX's `--eval_tasks`, `--eval_results_prefix` and `--iteration` win over the files; a config for
    eval.py needs no train_iters, optimizer or batch size."""
    import yaml

    import deepy
    from tests.unit.test_neox_args import write_yaml

    config = write_yaml(tmp_path, "model.yml", {**EVAL_ONLY, "load": None, "num_gpus": 1, "eval_tasks": ["piqa"],
                                                "tokenizer_type": "ByteLevelTokenizer",
                                                "iteration": 5})
    assert deepy.main(["eval.py", str(config), "--eval_tasks", "hellaswag", "lambada_*", "--iteration", "7",
                       "--eval_results_prefix", "out/run1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    settings = yaml.safe_load(out)["settings"]
    assert (settings["eval_tasks"], settings["iteration"], settings["eval_results_prefix"]) == (
        ["hellaswag", "lambada_*"], 7, "out/run1")
    assert "  iteration: 7  # the command line" in out.splitlines()
    assert settings["train_iters"] is None


def test_results_file_is_named_as_gpt_neox_names_it():
    from datetime import datetime

    from megatron.evaluation import results_path

    now = datetime(2026, 3, 4, 5, 6, 7)
    assert str(results_path("", now)) == "eval_results_03-04-2026-05-06-07.json"
    assert str(results_path("runs/pythia", now)) == "runs/pythia_eval_results_03-04-2026-05-06-07.json"


@pytest.mark.usefixtures("single_rank_world")
def test_a_stop_rule_ends_the_completion_at_the_token_it_holds_for():
    """How eval.py stops at a task's stop strings instead of generating max_gen_toks tokens each time."""
    from megatron.generation import Limits, Sampling, complete
    from megatron.model import build_model
    from tests.unit.test_model import randomize_, tiny_args

    model = build_model(tiny_args(pos_emb="rotary").architecture(), seed=3)
    randomize_(model)
    model.eval()
    limits = Limits(seq_length=32, maximum_tokens=10, eod=-1)
    full = complete(model, [5, 6, 7], limits, Sampling())
    stopped = complete(model, [5, 6, 7], limits, Sampling(), stop=lambda tokens: tokens == full.tokens[:4])
    assert len(full.tokens) == 10 and (stopped.tokens, stopped.finished) == (full.tokens[:4], False)
