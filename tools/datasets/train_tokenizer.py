"""Train a byte-level BPE tokenizer on local text files and write tokenizer.json.

    python tools/datasets/train_tokenizer.py --input 'corpus/*.txt' --output tokenizer.json --vocab-size 8192

Each input file is read as text (jsonl files: the `--jsonl-keys` fields of every line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.foreign_notices import hide_foreign_notices  # noqa: E402

hide_foreign_notices()  # before the imports below

from megatron.data.document_sources import expand_input_paths, iter_documents  # noqa: E402
from megatron.tokenizer import train_bpe_tokenizer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="comma-separated files or globs (.txt, .jsonl)")
    parser.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--jsonl-keys", nargs="+", default=["text"], help="jsonl fields to learn from")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = expand_input_paths(args.input)
    texts = (text for document in iter_documents(paths, args.jsonl_keys) for text in document.values())
    output = train_bpe_tokenizer(texts, args.output, args.vocab_size, args.min_frequency)
    print(output)


if __name__ == "__main__":
    main()
