"""Tokenizers of GPT-NeoX's types (GPT-2 BPE files, `tokenizers` JSON, sentencepiece, character level)
plus a byte-level one, built from settings by `build_tokenizer`; and BPE training."""

from megatron.tokenizer.base import EOD_TOKEN, PAD_TOKEN, Tokenizer
from megatron.tokenizer.bpe import GPT2BPETokenizer, HFTokenizer
from megatron.tokenizer.byte_level import ByteLevelTokenizer, CharLevelTokenizer
from megatron.tokenizer.errors import TokenizerError
from megatron.tokenizer.sentencepiece_model import SPMTokenizer
from megatron.tokenizer.tokenizer import TOKENIZER_TYPES, TokenizerSpec, build_tokenizer
from megatron.tokenizer.train import train_bpe_tokenizer

__all__ = [
    "EOD_TOKEN",
    "PAD_TOKEN",
    "TOKENIZER_TYPES",
    "ByteLevelTokenizer",
    "CharLevelTokenizer",
    "GPT2BPETokenizer",
    "HFTokenizer",
    "SPMTokenizer",
    "Tokenizer",
    "TokenizerError",
    "TokenizerSpec",
    "build_tokenizer",
    "train_bpe_tokenizer",
]
