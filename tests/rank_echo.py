"""A stand-in for train.py in launcher tests: each rank prints its rank and a digest of its settings."""

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, as for train.py

from megatron.neox_arguments import load_args_on_rank  # noqa: E402


def settings_digest(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


if __name__ == "__main__":
    args = load_args_on_rank()
    # one write per line: the ranks share the launcher's stdout, and print() writes the newline apart
    sys.stdout.write(f"RANK_ECHO rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
                     f"global_num_gpus={args.global_num_gpus} settings={settings_digest(args.to_dict())}\n")
    sys.stdout.flush()
