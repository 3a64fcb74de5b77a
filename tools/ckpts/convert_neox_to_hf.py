"""Convert a checkpoint of ours into a Hugging Face model folder that AutoModelForCausalLM loads.

    python tools/ckpts/convert_neox_to_hf.py --input CKPT_DIR [--tag TAG] --output HF_DIR
                                             [--architecture gpt_neox|llama|mistral|qwen2|qwen3] [--config FILE.yml ...]
                                             [--dtype fp32|bf16|fp16] [--max-shard-size 5GB] [--overwrite]
                                             [--peft [--base-model HF_DIR]]

GPT-NeoX's command line for this tool works too, flag for flag:

    python tools/ckpts/convert_neox_to_hf.py --input_dir CKPT_DIR/global_step<N> \\
        --config_file CKPT_DIR/global_step<N>/configs/neox_config.yml --output_dir HF_DIR \\
        [--precision auto|fp16|bf16|fp32] [--architecture neox|llama] [--no_save_tokenizer] \\
        [--vocab-is-hf-tokenizer] [--pad-token-id ID]

The architecture comes from the settings saved in the checkpoint, or from --config / --config_file YAML
files (for checkpoints without saved settings, e.g. GPT-NeoX pipeline checkpoints). Unset, the family
is the one the model came from (hf_model_type), else the one its architecture implies. An output folder
that already holds a model or a run is refused unless --overwrite replaces it.

A LoRA run's tag is written merged (W + scaling B A in fp32, then cast to --dtype), or with --peft as a PEFT
adapter folder (adapter_config.json, adapter_model.safetensors) that PeftModel.from_pretrained loads over the
base model: the Hugging Face folder the run's base came from, or --base-model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.foreign_notices import hide_foreign_notices  # noqa: E402

hide_foreign_notices()  # before the imports below

from megatron.checkpointing import LATEST_FILE, CheckpointError  # noqa: E402
from megatron.hf.config import FAMILIES  # noqa: E402
from megatron.hf.convert import DTYPES, convert_neox_to_hf  # noqa: E402
from megatron.hf.io import parse_size  # noqa: E402
from megatron.neox_arguments.errors import ConfigError  # noqa: E402

# GPT-NeoX's --architecture names for the Hugging Face families (its default, neox, is GPT-NeoX's model)
GPT_NEOX_ARCHITECTURES = {"neox": "gpt_neox", "llama": "llama"}
GPT_NEOX_PRECISIONS = ("auto", *sorted(DTYPES))  # auto: the dtype of the checkpoint's weights


def parse_command_line(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", type=Path, help="checkpoint folder (holds `latest` and tags)")
    source.add_argument("--input_dir", type=Path, help="GPT-NeoX's flag: the tag folder, e.g. CKPT_DIR/global_step1000")
    parser.add_argument("--tag", help="with --input: tag to convert (default: the one in `latest`)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--output", type=Path, help="Hugging Face model folder to write")
    target.add_argument("--output_dir", type=Path, help="GPT-NeoX's name of --output")
    parser.add_argument("--architecture", choices=(*FAMILIES, *GPT_NEOX_ARCHITECTURES),
                        help="default: the family the model came from (hf_model_type), else the one its "
                             "architecture implies (GPT-NeoX's neox is gpt_neox)")
    configs = parser.add_mutually_exclusive_group()
    configs.add_argument("--config", type=Path, nargs="+", help="YAML files with the model settings")
    configs.add_argument("--config_file", type=Path, help="GPT-NeoX's flag: one YAML file with the model settings")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--dtype", choices=sorted(DTYPES), help="default: the dtype of the checkpoint's weights")
    precision.add_argument("--precision", choices=GPT_NEOX_PRECISIONS, help="GPT-NeoX's name of --dtype (auto: its default)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the model or run already in the output folder (its config, weights, tokenizer, "
                             "latest, tags); other files there are kept")
    parser.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this (e.g. 5GB, 200MB)")
    parser.add_argument("--no_save_tokenizer", action="store_true", help="do not write the run's tokenizer")
    parser.add_argument("--vocab-is-hf-tokenizer", action="store_true",
                        help="GPT-NeoX's flag; the tokenizer is written from vocab_file (a tokenizers JSON) either way")
    parser.add_argument("--pad-token-id", type=int, help="the padding token's id (default: <|padding|>'s)")
    parser.add_argument("--peft", action="store_true",
                        help="write a LoRA run's adapters as a PEFT adapter folder instead of the merged model")
    parser.add_argument("--base-model", type=Path,
                        help="with --peft: the Hugging Face folder of the base model (default: the one the run "
                             "recorded as its base)")
    options = parser.parse_args(argv)
    if options.tag and options.input_dir:
        parser.error("--tag goes with --input; --input_dir names the tag folder itself")
    if options.base_model and not options.peft:
        parser.error("--base-model goes with --peft (the merged model needs no base)")
    return options


def checkpoint_and_tag(options: argparse.Namespace) -> tuple[Path, str | None]:
    """(the save directory, the tag); GPT-NeoX's --input_dir names the tag folder, or a save folder with `latest`."""
    if options.input is not None:
        return options.input, options.tag
    if (options.input_dir / LATEST_FILE).is_file():
        return options.input_dir, None
    return options.input_dir.parent, options.input_dir.name


def main(argv: list[str] | None = None) -> int:
    options = parse_command_line(argv)
    ckpt_dir, tag = checkpoint_and_tag(options)
    config_files = options.config or ([options.config_file] if options.config_file else None)
    dtype = options.dtype or (options.precision if options.precision != "auto" else None)
    try:
        out = convert_neox_to_hf(
            ckpt_dir, options.output or options.output_dir, tag,
            GPT_NEOX_ARCHITECTURES.get(options.architecture, options.architecture), config_files, dtype,
            parse_size(options.max_shard_size), progress=True, save_tokenizer=not options.no_save_tokenizer,
            pad_token_id=options.pad_token_id, overwrite=options.overwrite, peft=options.peft,
            base_model=options.base_model,
        )
    except (CheckpointError, ConfigError) as err:  # HFConversionError is a CheckpointError
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
