"""What the rest of the code needs from a tokenizer, GPT-NeoX's special tokens, and file checks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from megatron.tokenizer.errors import TokenizerError

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"


class Tokenizer(ABC):
    """Token ids of a text and back; `vocab_size` is what GPT-NeoX's tokenizer of the same type reports
    (before padding to make_vocab_size_divisible_by), `eod` ends documents."""

    vocab_size: int
    eod: int
    pad: int

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: list[int]) -> str: ...

    def readable_text(self, ids: list[int]) -> str:
        """The text of `ids` without special tokens (what a reward function reads)."""
        return self.detokenize(ids)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]


def existing_file(setting: str, path: str | Path | None, kind: str, what: str) -> Path:
    """`path` as a Path if it is a file; else a TokenizerError naming the setting and what it should hold."""
    if not path:
        raise TokenizerError(f"tokenizer_type {kind} needs {setting} ({what}); set {setting}")
    found = Path(path)
    if not found.is_file():
        raise TokenizerError(
            f"{setting} {str(found)!r} (for tokenizer_type {kind}) does not exist or is not a file; "
            f"set {setting} to {what}"
        )
    return found
