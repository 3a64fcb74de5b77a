"""eval.py's run: the harness's tasks on the model, and the results file GPT-NeoX writes.

`eval_tasks` names the tasks (the harness's names or glob patterns, matched as GPT-NeoX matches them);
`eval_include_path` adds directories of task YAML files (local tasks); `eval_num_fewshot` examples
precede each question (0, as in GPT-NeoX's eval.py: tasks whose config fixes 0 keep it);
`eval_bootstrap_iters` resamples estimate the standard errors without a closed form. Global rank 0
writes `<eval_results_prefix>_eval_results_<%m-%d-%Y-%H-%M-%S>.json` (no prefix: `eval_results_...`),
as GPT-NeoX does: the harness's results with `config` naming the model `neox` and its settings.
"""

from __future__ import annotations

import fnmatch
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from megatron.evaluation.errors import EvaluationError

INSTALL_HINT = "pip install -e '.[eval]'"


def _include_paths(paths: str | list[str] | None) -> list[str]:
    return [] if paths is None else [paths] if isinstance(paths, str) else list(paths)


def check_evaluation_settings(args) -> None:
    """What eval.py cannot run with, before any model is built."""
    if not args.eval_tasks:
        raise EvaluationError("eval_tasks: not set; name the harness's tasks to run, e.g. "
                              "`python deepy.py eval.py -d configs model.yml --eval_tasks lambada_openai hellaswag`")
    if not args.load:
        raise EvaluationError("load: not set; eval.py scores a trained model: set `load` to its checkpoint directory "
                              "(or a Hugging Face model folder)")
    for path in _include_paths(args.eval_include_path):
        if not Path(path).is_dir():
            raise EvaluationError(f"eval_include_path: {path!r} is not a directory; set it to directories of task "
                                  "YAML files")
    for name in ("eval_num_fewshot", "eval_bootstrap_iters"):
        if getattr(args, name) < 0:
            raise EvaluationError(f"{name}: {getattr(args, name)} is negative; use 0 or more")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise EvaluationError(f"eval.py needs the LM Evaluation Harness (lm-eval), which is not installed: "
                              f"{INSTALL_HINT}") from None


def task_names(patterns: list[str], known: list[str]) -> list[str]:
    """The harness's names matching `patterns` (glob patterns, as GPT-NeoX matches them), in the order given."""
    names: list[str] = []
    for pattern in patterns:
        matches = fnmatch.filter(known, pattern)
        if not matches:
            raise EvaluationError(f"eval_tasks: the harness has no task {pattern!r}; `lm-eval ls tasks` lists them "
                                  "(a local task: put its YAML file in a directory named by eval_include_path)")
        names += [name for name in matches if name not in names]
    return names


def _task_manager(patterns: list[str], include_paths: list[str]):
    """The harness's index of tasks: only eval_include_path's when every task is a name found there (indexing
    the harness's own thousands of task files takes a while), else the harness's and eval_include_path's."""
    from lm_eval.tasks import TaskManager

    if include_paths and not any(set(pattern) & set("*?[") for pattern in patterns):
        local = TaskManager(include_path=include_paths, include_defaults=False)
        if set(patterns) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_paths or None)


def evaluate(model, tokenizer, args) -> dict[str, Any] | None:
    """The harness's results of `args.eval_tasks` on `model` (on every rank: a collective); None where
    the harness leaves aggregation to another rank."""
    import lm_eval

    from megatron.evaluation.harness_model import NeoXLanguageModel

    task_manager = _task_manager(list(args.eval_tasks), _include_paths(args.eval_include_path))
    names = task_names(list(args.eval_tasks), task_manager.all_tasks)
    batch_size = args.train_micro_batch_size_per_gpu or 1
    language_model = NeoXLanguageModel(model, tokenizer, max_length=args.max_position_embeddings,
                                       batch_size=batch_size)
    results = lm_eval.simple_evaluate(model=language_model, tasks=names, num_fewshot=args.eval_num_fewshot,
                                      bootstrap_iters=args.eval_bootstrap_iters, log_samples=False,
                                      task_manager=task_manager)
    if results is None:
        return None
    for task in results["results"].values():
        task.pop("alias", None)  # GPT-NeoX drops it
    results["config"].update(model="neox", model_args=args.to_dict(), batch_size=batch_size,
                             device=str(language_model.device))
    return results


def results_path(prefix: str, now: datetime) -> Path:
    name = f"eval_results_{now.strftime('%m-%d-%Y-%H-%M-%S')}.json"
    return Path(f"{prefix}_{name}" if prefix else name)


def write_results(results: dict[str, Any], eval_results_prefix: str | None, now: datetime) -> Path:
    from lm_eval.utils import handle_non_serializable

    from megatron.fsio import write_text_atomically

    path = results_path(eval_results_prefix, now)
    if path.parent != Path():
        path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(results, indent=4, default=handle_non_serializable))
    return path
