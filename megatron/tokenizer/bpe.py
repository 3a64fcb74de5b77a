"""Tokenizers run by the Hugging Face `tokenizers` library: a tokenizer.json (HFTokenizer) and GPT-2's
vocab.json + merges.txt pair (GPT2BPETokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from megatron.tokenizer.base import EOD_TOKEN, PAD_TOKEN, Tokenizer, existing_file
from megatron.tokenizer.errors import TokenizerError


class _LibraryTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer`; "<|endoftext|>" ends documents, "<|padding|>" pads (else eod)."""

    def __init__(self, tokenizer, kind: str, described_by: str, vocab_size: int, eod_token: str = EOD_TOKEN,
                 hint: str = "add it as a special token when training the tokenizer"):
        eod = tokenizer.token_to_id(eod_token)
        if eod is None:
            raise TokenizerError(f"{described_by} has no {eod_token!r} token, which {kind} uses to end documents; {hint}")
        pad = tokenizer.token_to_id(PAD_TOKEN)
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eod = eod
        self.pad = eod if pad is None else pad

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def readable_text(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


def _folder_eos_token(tokenizer_file: Path) -> str | None:
    """The eos_token of the tokenizer_config.json beside `tokenizer_file` (a Hugging Face folder's), if any."""
    config = tokenizer_file.parent / "tokenizer_config.json"
    try:
        token = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else None


class HFTokenizer(_LibraryTokenizer):
    """GPT-NeoX's HFTokenizer: a `tokenizers` JSON file; vocab_size counts the added tokens too.

    Documents end with "<|endoftext|>" as in GPT-NeoX. A tokenizer without it (Llama 3's, Qwen's, ...) ends
    them with the eos_token of the tokenizer_config.json beside it, the token its model was trained to end
    a text with; GPT-NeoX leaves the end of a document undefined there.
    """

    def __init__(self, vocab_file: str | Path):
        from tokenizers import Tokenizer as LibraryTokenizer

        path = existing_file("vocab_file", vocab_file, "HFTokenizer",
                             "a `tokenizers` JSON file (tools/datasets/train_tokenizer.py writes one)")
        try:
            tokenizer = LibraryTokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception for any parse error
            raise TokenizerError(
                f"vocab_file {str(path)!r} is not a readable `tokenizers` JSON file ({err}); "
                "point vocab_file at a tokenizer.json"
            ) from err
        eod_token = EOD_TOKEN
        if tokenizer.token_to_id(EOD_TOKEN) is None:
            eod_token = _folder_eos_token(path) or EOD_TOKEN
        super().__init__(tokenizer, "HFTokenizer", f"vocab_file {str(path)!r}",
                         tokenizer.get_vocab_size(with_added_tokens=True), eod_token,
                         "add it as a special token, or put a tokenizer_config.json naming the eos_token beside it")


class GPT2BPETokenizer(_LibraryTokenizer):
    """GPT-NeoX's default tokenizer: GPT-2's byte-level BPE from vocab_file (vocab.json, token -> id) and
    merge_file (merges.txt). vocab_size is the number of entries in vocab.json, which must hold
    "<|endoftext|>"; that token is matched as a whole wherever it appears in a text, as GPT-2's does."""

    def __init__(self, vocab_file: str | Path, merge_file: str | Path):
        from tokenizers import Tokenizer as LibraryTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        vocab = existing_file("vocab_file", vocab_file, "GPT2BPETokenizer", "GPT-2's vocab.json")
        merges = existing_file("merge_file", merge_file, "GPT2BPETokenizer", "GPT-2's merges.txt")
        try:
            model = models.BPE.from_file(str(vocab), str(merges))
        except Exception as err:  # the Rust side raises a bare Exception for any parse error
            raise TokenizerError(
                f"vocab_file {str(vocab)!r} and merge_file {str(merges)!r} are not a GPT-2 vocab.json "
                f"(token -> id) and merges.txt (one 'left right' pair a line) ({err})"
            ) from err
        tokenizer = LibraryTokenizer(model)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=False)
        super().__init__(tokenizer, "GPT2BPETokenizer", f"vocab_file {str(vocab)!r}", vocab_size)
        tokenizer.add_special_tokens([EOD_TOKEN])  # already in vocab.json (checked above): no new id
