"""Convert a Hugging Face GPTNeoXForCausalLM / LlamaForCausalLM folder into a module-only checkpoint of ours.

    python tools/ckpts/convert_hf_to_neox.py --input HF_DIR --output OUT_DIR [--dtype fp32|bf16|fp16]
                                             [--config-out FILE.yml] [--model-parallel-size N]
                                             [--pipe-parallel-size P] [--overwrite]

Writes OUT_DIR/latest, OUT_DIR/global_step0/mp_rank_<MP>_model_states.pt for each of the N
tensor-parallel ranks (default 1; no optimizer states), or with P >= 1 (GPT-NeoX's meaning of
--pipe-parallel-size: a pipe module) GPT-NeoX's layer files layer_<II>-model_<MP>-model_states.pt,
which a run at any pipeline size loads, and with --config-out, a YAML of the settings that
reproduce the model (fine-tune with `load: OUT_DIR` and `finetune: true`). An OUT_DIR that already
holds a model or a run (a `latest`, tags, weights) is refused unless --overwrite replaces them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.foreign_notices import hide_foreign_notices  # noqa: E402

hide_foreign_notices()  # before the imports below

from megatron.checkpointing import CheckpointError  # noqa: E402
from megatron.hf.convert import DTYPES, convert_hf_to_neox  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, type=Path, help="Hugging Face model folder (config.json + weights)")
    parser.add_argument("--output", required=True, type=Path, help="checkpoint folder to write")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="dtype of the saved weights")
    parser.add_argument("--config-out", type=Path, help="write the model's settings as YAML here")
    parser.add_argument("--model-parallel-size", type=int, default=1,
                        help="tensor-parallel ranks to split the weights for (one mp_rank file each)")
    parser.add_argument("--pipe-parallel-size", type=int, default=0,
                        help="0: the weights in the mp_rank files; >= 1: GPT-NeoX's layer files (P stages' mp_rank files)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the model or run already in --output (its latest, tags, weights, tokenizer) and "
                             "an existing --config-out; other files there are kept")
    options = parser.parse_args(argv)
    try:
        result = convert_hf_to_neox(options.input, options.output, options.dtype, options.config_out, progress=True,
                                    model_parallel_size=options.model_parallel_size,
                                    pipe_parallel_size=options.pipe_parallel_size, overwrite=options.overwrite)
    except CheckpointError as err:  # HFConversionError is one, and so is a refused weight file
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {result.tag_dir}" + (f" and {result.config_path}" if result.config_path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
