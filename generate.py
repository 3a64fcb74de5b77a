"""Sample a trained model, the GPT-NeoX way; started by deepy.py through the DeepSpeed launcher:

    python deepy.py generate.py -d configs tiny.yml local_setup.yml text_generation.yml

`load` names the checkpoint (ours, GPT-NeoX's or a Hugging Face folder); `text_gen_type`,
`maximum_tokens`, `temperature`, `top_k`, `top_p`, `recompute`, `num_samples`, `sample_input_file`,
`sample_output_file` and `prompt_end` say what to generate (megatron/generation/samples.py).
"""

from megatron.foreign_notices import hide_foreign_notices

hide_foreign_notices()  # before the imports below

from megatron.neox_arguments import load_args_on_rank  # noqa: E402
from megatron.runtime.rank_errors import exit_after_rank  # noqa: E402


def main() -> None:
    from megatron.generation import check_generation_settings, generate_samples
    from megatron.logging import get_logger
    from megatron.ranks import global_rank
    from megatron.tokenizer import build_tokenizer
    from megatron.training.loop import setup_for_inference

    args = load_args_on_rank()
    check_generation_settings(args)
    tokenizer = build_tokenizer(args)
    engine = setup_for_inference(args)
    generate_samples(engine.module, tokenizer, args, global_rank(), get_logger())


if __name__ == "__main__":
    exit_after_rank(main)
