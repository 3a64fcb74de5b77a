"""Train a byte-level BPE tokenizer on local text with the `tokenizers` library."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from megatron.tokenizer.base import EOD_TOKEN, PAD_TOKEN
from megatron.tokenizer.errors import TokenizerError


def train_bpe_tokenizer(
    texts: Iterable[str], output_file: str | Path, vocab_size: int = 4096, min_frequency: int = 2
) -> Path:
    """Learn byte-level BPE merges from `texts`; write a tokenizer.json with "<|endoftext|>" (id 0)
    and "<|padding|>" (id 1) as special tokens. Returns the written path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special_tokens = [EOD_TOKEN, PAD_TOKEN]
    if vocab_size < 256 + len(special_tokens):
        raise TokenizerError(
            f"vocab_size {vocab_size} is too small for byte-level BPE: it needs at least "
            f"{256 + len(special_tokens)} (256 bytes plus {special_tokens})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    output = Path(output_file)
    output.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output))
    return output
