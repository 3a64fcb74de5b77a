"""Score a trained model with the LM Evaluation Harness, the GPT-NeoX way; started by deepy.py:

    python deepy.py eval.py -d configs tiny.yml local_setup.yml --eval_tasks lambada_openai hellaswag

`load` names the checkpoint (ours, GPT-NeoX's or a Hugging Face folder); `eval_tasks` the harness's
tasks (`--eval_tasks` overrides the files). Global rank 0 prints the harness's table and writes
`<eval_results_prefix>_eval_results_<date-time>.json` (megatron/evaluation/eval_run.py). Needs the
harness: pip install -e '.[eval]'.
"""

from megatron.foreign_notices import hide_foreign_notices

hide_foreign_notices()  # before the imports below

from megatron.neox_arguments import load_args_on_rank  # noqa: E402
from megatron.runtime.rank_errors import exit_after_rank  # noqa: E402


def main() -> None:
    from datetime import datetime

    from megatron.evaluation import check_evaluation_settings, evaluate, write_results
    from megatron.logging import get_logger
    from megatron.ranks import global_rank
    from megatron.tokenizer import build_tokenizer
    from megatron.training.loop import setup_for_inference

    args = load_args_on_rank()
    check_evaluation_settings(args)
    tokenizer = build_tokenizer(args)
    engine = setup_for_inference(args)
    started = datetime.now()
    results = evaluate(engine.module, tokenizer, args)
    if global_rank() == 0 and results is not None:
        from lm_eval.utils import make_table

        print(make_table(results), flush=True)
        get_logger().info(f"wrote the evaluation results to {write_results(results, args.eval_results_prefix, started)}")


if __name__ == "__main__":
    exit_after_rank(main)
