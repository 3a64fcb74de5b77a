"""The one place a tokenizer is built from settings: `build_tokenizer(settings) -> Tokenizer`."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.tokenizer.base import Tokenizer
from megatron.tokenizer.bpe import GPT2BPETokenizer, HFTokenizer
from megatron.tokenizer.byte_level import ByteLevelTokenizer, CharLevelTokenizer
from megatron.tokenizer.errors import TokenizerError
from megatron.tokenizer.sentencepiece_model import SPMTokenizer

# GPT-NeoX's tokenizer types (HFGPT2Tokenizer aside: it downloads GPT-2 from the Hub), then ours.
TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HFTokenizer",
    "SPMTokenizer",
    "CharLevelTokenizer",
    "ByteLevelTokenizer",
)

# the settings naming the files each tokenizer_type is built from, and what they hold
TOKENIZER_FILES = {
    "GPT2BPETokenizer": {"vocab_file": "GPT-2's vocab.json", "merge_file": "GPT-2's merges.txt"},
    "HFTokenizer": {"vocab_file": "a tokenizers JSON file"},
    "SPMTokenizer": {"vocab_file": "a sentencepiece model"},
}


@dataclass(frozen=True)
class TokenizerSpec:
    """The settings a tokenizer is built from (plain values, so worker processes can rebuild it)."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None

    @classmethod
    def of(cls, settings) -> TokenizerSpec:
        return cls(settings.tokenizer_type, settings.vocab_file, getattr(settings, "merge_file", None))


def build_tokenizer(settings) -> Tokenizer:
    """The tokenizer named by `settings.tokenizer_type`, from its `vocab_file` (and `merge_file`).
    GPT-NeoX matches the type name ignoring case; so does this."""
    spec = TokenizerSpec.of(settings)
    kind = {name.lower(): name for name in TOKENIZER_TYPES}.get(str(spec.tokenizer_type).lower())
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(spec.vocab_file, spec.merge_file)
    if kind == "HFTokenizer":
        return HFTokenizer(spec.vocab_file)
    if kind == "SPMTokenizer":
        return SPMTokenizer(spec.vocab_file)
    if kind == "CharLevelTokenizer":
        return CharLevelTokenizer()
    if kind == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    raise TokenizerError(
        f"tokenizer_type {spec.tokenizer_type!r} is unknown; use one of {', '.join(TOKENIZER_TYPES)}"
    )
