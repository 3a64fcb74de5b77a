"""The settings that depend on files, resolved once, before any rank starts (deepy.py calls this).

`embedded_corpus: true` points data_path, vocab_file and tokenizer_type at the embedded corpus
(built once and cached); the tokenizer gives padded_vocab_size. Both go through validation again
(`NeoXArgs.with_values`), and every rank receives the complete, read-only result: no rank changes a
setting, and every rank has the very same ones. The corpus and the tokenizer file must therefore be
readable where deepy.py runs (and, on several nodes, at the same path on each: a shared filesystem).
"""

from __future__ import annotations

from megatron.neox_arguments import ConfigError, NeoXArgs, padded_vocab_size
from megatron.neox_arguments.derived import EMBEDDED_CORPUS_SOURCE


def resolve_run_settings(args: NeoXArgs) -> NeoXArgs:
    """`args` with the embedded corpus and padded_vocab_size resolved; unchanged when already resolved."""
    from megatron.tokenizer import TokenizerError, build_tokenizer

    if args.embedded_corpus and args.source_of("data_path") != EMBEDDED_CORPUS_SOURCE:
        from megatron.data.embedded_corpus import ensure_embedded_corpus

        corpus = ensure_embedded_corpus()
        args = args.with_values({"data_path": corpus.data_prefix, "vocab_file": corpus.vocab_file,
                                 "tokenizer_type": "HFTokenizer"}, EMBEDDED_CORPUS_SOURCE)
    if args.padded_vocab_size is not None:
        return args
    try:
        tokenizer = build_tokenizer(args)
    except TokenizerError as err:
        raise ConfigError(f"tokenizer_type / vocab_file: {err}") from None
    padded = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.model_parallel_size)
    return args.with_values({"padded_vocab_size": padded},
                            f"tokenizer {args.vocab_file or args.tokenizer_type} ({tokenizer.vocab_size} tokens)")
