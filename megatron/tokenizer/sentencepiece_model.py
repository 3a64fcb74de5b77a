"""GPT-NeoX's SPMTokenizer: a sentencepiece model file (Llama's tokenizer.model, for one)."""

from __future__ import annotations

from pathlib import Path

from megatron.tokenizer.base import EOD_TOKEN, Tokenizer, existing_file
from megatron.tokenizer.errors import TokenizerError


class SPMTokenizer(Tokenizer):
    """vocab_size is the model's number of pieces. eod is the id of the piece "<|endoftext|>", which
    sentencepiece answers with the unknown piece's id when the model has no such piece (Llama's has
    none, so its documents end with <unk>, id 0), exactly as in GPT-NeoX. pad is the model's pad
    piece, else eod. No BOS/EOS pieces are added to a text."""

    def __init__(self, vocab_file: str | Path):
        import sentencepiece

        path = existing_file("vocab_file", vocab_file, "SPMTokenizer", "a sentencepiece model (tokenizer.model)")
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as err:
            raise TokenizerError(
                f"vocab_file {str(path)!r} is not a readable sentencepiece model ({err}); "
                "point vocab_file at a tokenizer.model"
            ) from err
        self.vocab_size = self._processor.get_piece_size()
        self.eod = self._processor.piece_to_id(EOD_TOKEN)
        pad = self._processor.pad_id()
        self.pad = pad if pad >= 0 else self.eod

    def tokenize(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._processor.encode(list(texts))

    def detokenize(self, ids: list[int]) -> str:
        return self._processor.decode(list(ids))
