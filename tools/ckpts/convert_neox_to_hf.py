"""Convert a checkpoint of ours into a Hugging Face model folder that AutoModelForCausalLM loads.

    python tools/ckpts/convert_neox_to_hf.py --input CKPT_DIR [--tag TAG] --output HF_DIR
                                             [--architecture gpt_neox|llama|mistral|qwen2|qwen3] [--config FILE.yml ...]
                                             [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]

The architecture comes from the settings saved in the checkpoint, or from --config YAML files
(for checkpoints without saved settings, e.g. GPT-NeoX pipeline checkpoints).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.checkpointing.errors import CheckpointError  # noqa: E402
from megatron.hf.config import FAMILIES  # noqa: E402
from megatron.hf.convert import DTYPES, convert_neox_to_hf  # noqa: E402
from megatron.hf.io import parse_size  # noqa: E402
from megatron.neox_arguments.errors import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, type=Path, help="checkpoint folder (holds `latest` and tags)")
    parser.add_argument("--tag", help="tag to convert (default: the one in `latest`)")
    parser.add_argument("--output", required=True, type=Path, help="Hugging Face model folder to write")
    parser.add_argument("--architecture", choices=FAMILIES, help="default: the family the model came from (hf_model_type), else the one its architecture implies")
    parser.add_argument("--config", type=Path, nargs="+", help="YAML files with the model settings")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the dtype of the checkpoint's weights")
    parser.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this (e.g. 5GB, 200MB)")
    options = parser.parse_args(argv)
    try:
        out = convert_neox_to_hf(
            options.input, options.output, options.tag, options.architecture, options.config, options.dtype,
            parse_size(options.max_shard_size), progress=True,
        )
    except (CheckpointError, ConfigError) as err:  # HFConversionError is a CheckpointError
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
