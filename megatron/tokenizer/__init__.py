"""Tokenizer construction (HF `tokenizers` files, byte-level fallback) and BPE training."""

from megatron.tokenizer.errors import TokenizerError
from megatron.tokenizer.tokenizer import (
    EOD_TOKEN,
    PAD_TOKEN,
    ByteLevelTokenizer,
    CharLevelTokenizer,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
)
from megatron.tokenizer.train import train_bpe_tokenizer

__all__ = [
    "EOD_TOKEN",
    "PAD_TOKEN",
    "ByteLevelTokenizer",
    "CharLevelTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer",
    "train_bpe_tokenizer",
]
