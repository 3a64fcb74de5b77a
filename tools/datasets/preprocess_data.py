"""Tokenize jsonl or plain-text files into GPT-NeoX mmap indexed datasets (.bin/.idx).

    python tools/datasets/preprocess_data.py --input 'data/*.jsonl' --output-prefix data/mydata \\
        --tokenizer-type HFTokenizer --vocab-file tokenizer.json --append-eod --workers 4

(GPT-NeoX's arguments: --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt,
--tokenizer-type SPMTokenizer --vocab-file tokenizer.model, ...) writes data/mydata_text_document.bin/.idx (one pair per --jsonl-keys field); train with
data_path: data/mydata_text_document. A plain-text file is one document.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.foreign_notices import hide_foreign_notices  # noqa: E402

hide_foreign_notices()  # before the imports below

from megatron.data.document_sources import expand_input_paths, iter_documents  # noqa: E402
from megatron.data.errors import DataError  # noqa: E402
from megatron.data.preprocessing import tokenize_to_indexed_datasets  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES, TokenizerError, TokenizerSpec  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="comma-separated files or globs (.jsonl/.json or text)")
    parser.add_argument("--output-prefix", required=True, help="outputs are <prefix>_<key>_document.bin/.idx")
    parser.add_argument("--jsonl-keys", nargs="+", default=["text"], help="jsonl fields to tokenize")
    parser.add_argument("--num-docs", type=int, default=None, help="number of documents, for the progress bar")
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument("--vocab-file", default=None,
                        help="tokenizer.json (HFTokenizer), vocab.json (GPT2BPETokenizer), tokenizer.model (SPMTokenizer)")
    parser.add_argument("--merge-file", default=None, help="merges.txt (GPT2BPETokenizer)")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    parser.add_argument("--dataset-impl", default="mmap", choices=("mmap",), help="output format")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--log-interval", type=int, default=100, help="refresh the rates every N documents")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        run(args)
    except (DataError, TokenizerError) as err:
        sys.exit(f"preprocess_data.py: error: {err}")


def run(args: argparse.Namespace) -> None:
    documents = iter_documents(expand_input_paths(args.input), args.jsonl_keys)
    result = tokenize_to_indexed_datasets(
        documents,
        args.output_prefix,
        args.jsonl_keys,
        TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file),
        append_eod=args.append_eod,
        workers=args.workers,
        progress=True,
        log_interval=args.log_interval,
        expected_documents=args.num_docs,
    )
    print(result.summary("documents"))


if __name__ == "__main__":
    main()
