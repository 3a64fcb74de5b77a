"""Tokenizers that need no file: token ids are the UTF-8 bytes of the text."""

from __future__ import annotations

from megatron.tokenizer.base import Tokenizer


class _ByteTokenizer(Tokenizer):
    """Token ids are the UTF-8 bytes of the text; the special ids lie outside 0..255 (or reuse one)."""

    def __init__(self, vocab_size: int, eod: int, pad: int):
        self.vocab_size = vocab_size
        self.eod = eod
        self.pad = pad

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256 and i not in (self.eod, self.pad)).decode(
            "utf-8", errors="replace"
        )


class ByteLevelTokenizer(_ByteTokenizer):
    """256 byte ids, then eod (256) and pad (257)."""

    def __init__(self):
        super().__init__(vocab_size=258, eod=256, pad=257)


class CharLevelTokenizer(_ByteTokenizer):
    """GPT-NeoX's CharLevelTokenizer: byte ids in a vocabulary of 512, eod 0 (NUL) and pad 1."""

    def __init__(self):
        super().__init__(vocab_size=512, eod=0, pad=1)
