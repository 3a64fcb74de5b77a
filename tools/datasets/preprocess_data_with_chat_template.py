"""Tokenize chat jsonl through a Hugging Face tokenizer's chat template into GPT-NeoX SFT datasets.

    python tools/datasets/preprocess_data_with_chat_template.py --input data/chats.jsonl \\
        --output-prefix data/sft --tokenizer-path path/to/hf_model --jsonl-keys messages

writes data/sft_messages_document.bin/.idx (tokens) and data/sft_messages_label_document.bin/.idx
(the token where it is trained, -100 where masked); train with train_data_paths: [data/sft_messages_document]
and train_label_data_paths: [data/sft_messages_label_document]. By default only the --generation-role's turns
are trained; --only-last trains only the final turn, --no-mask every token, --for-rm masks all but the
reward position. --reward-key also writes data/sft_messages_reward_document (one value per chat).
GPT-NeoX's command line, flag for flag.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.foreign_notices import hide_foreign_notices  # noqa: E402

hide_foreign_notices()  # before the imports below

from megatron.data.chat_preprocessing import ChatOptions, chats_to_indexed_datasets  # noqa: E402
from megatron.data.document_sources import expand_input_paths  # noqa: E402
from megatron.data.errors import DataError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="comma-separated jsonl files or globs")
    parser.add_argument("--jsonl-keys", nargs="+", default=["conversation"],
                        help="fields holding a chat (a list of {role, content} messages)")
    parser.add_argument("--no-mask", action="store_true", help="train every token")
    parser.add_argument("--for-rm", action="store_true", help="reward-model data: mask all but the reward position")
    parser.add_argument("--generation-role", default="assistant", help="the role whose turns are trained")
    parser.add_argument("--only-last", action="store_true", help="train only the last turn (if it is the generation role's)")
    parser.add_argument("--reward-key", default=None, help="field holding a number per chat, written as rewards")
    parser.add_argument("--binary-reward", action="store_true", help="rewards become +1 (positive) or -1 (otherwise)")
    parser.add_argument("--num-docs", type=int, default=None, help="number of chats, for the progress bar")
    parser.add_argument("--tokenizer-path", required=True, help="local Hugging Face tokenizer folder with a chat template")
    parser.add_argument("--ftfy", action="store_true", help="accepted for GPT-NeoX's command line; chats are not altered")
    parser.add_argument("--output-prefix", required=True, help="outputs are <prefix>_<key>[_label|_reward]_document")
    parser.add_argument("--dataset-impl", default="mmap", choices=("mmap",), help="output format")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--log-interval", type=int, default=100, help="refresh the rates every N chats")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.no_mask and args.for_rm:
        parser.error("--no-mask and --for-rm contradict each other; choose one")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    options = ChatOptions(tuple(args.jsonl_keys), not args.no_mask, args.for_rm, args.generation_role, args.only_last,
                          args.reward_key, args.binary_reward)
    try:
        result = chats_to_indexed_datasets(expand_input_paths(args.input), args.output_prefix, args.tokenizer_path,
                                           options, workers=args.workers, progress=True,
                                           log_interval=args.log_interval, expected_documents=args.num_docs)
    except DataError as err:
        sys.exit(f"preprocess_data_with_chat_template.py: error: {err}")
    print(result.summary("chats"))


if __name__ == "__main__":
    main()
