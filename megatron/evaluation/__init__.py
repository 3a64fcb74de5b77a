"""Scoring a trained model with the LM Evaluation Harness (eval.py): GPT-NeoX's settings and results file."""

from megatron.evaluation.errors import EvaluationError
from megatron.evaluation.eval_run import check_evaluation_settings, evaluate, results_path, write_results

__all__ = ["EvaluationError", "check_evaluation_settings", "evaluate", "results_path", "write_results"]
