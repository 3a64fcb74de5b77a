"""Tokenizers: a `tokenizers` JSON file (GPT-NeoX's HFTokenizer) and two that need no file."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from megatron.tokenizer.errors import TokenizerError

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"


class Tokenizer(ABC):
    """What the rest of the code needs from a tokenizer."""

    vocab_size: int
    eod: int
    pad: int

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: list[int]) -> str: ...

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` file; "<|endoftext|>" ends documents, "<|padding|>" pads (else eod)."""

    def __init__(self, vocab_file: str | Path):
        from tokenizers import Tokenizer as _RustTokenizer

        path = Path(vocab_file)
        if not path.is_file():
            raise TokenizerError(
                f"vocab_file {str(path)!r} does not exist or is not a file; set vocab_file to a "
                "`tokenizers` JSON file (tools/datasets/train_tokenizer.py writes one)"
            )
        try:
            self._tokenizer = _RustTokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception for any parse error
            raise TokenizerError(
                f"vocab_file {str(path)!r} is not a readable `tokenizers` JSON file ({err}); "
                "point vocab_file at a tokenizer.json"
            ) from err
        eod = self._tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise TokenizerError(
                f"vocab_file {str(path)!r} has no {EOD_TOKEN!r} token, which GPT-NeoX uses to end "
                "documents; add it as a special token when training the tokenizer"
            )
        pad = self._tokenizer.token_to_id(PAD_TOKEN)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod = eod
        self.pad = eod if pad is None else pad

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


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
    """GPT-NeoX's CharLevelTokenizer: byte ids in a vocabulary of 512 with eod 0 (the NUL byte)."""

    def __init__(self):
        super().__init__(vocab_size=512, eod=0, pad=511)


TOKENIZER_TYPES = ("HFTokenizer", "ByteLevelTokenizer", "CharLevelTokenizer")


def build_tokenizer(args) -> Tokenizer:
    """The tokenizer named by `args.tokenizer_type` (and `args.vocab_file` for HFTokenizer)."""
    kind = args.tokenizer_type
    if kind == "HFTokenizer":
        if not args.vocab_file:
            raise TokenizerError(
                "tokenizer_type HFTokenizer needs vocab_file (a `tokenizers` JSON file); set vocab_file "
                "or use tokenizer_type ByteLevelTokenizer, which needs no file"
            )
        return HFTokenizer(args.vocab_file)
    if kind == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if kind == "CharLevelTokenizer":
        return CharLevelTokenizer()
    raise TokenizerError(f"tokenizer_type {kind!r} is unknown; use one of {', '.join(TOKENIZER_TYPES)}")

