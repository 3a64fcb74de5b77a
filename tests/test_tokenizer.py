"""Tokenizers: round trips through a BPE file trained here, the byte-level ones, errors that name the setting."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron.tokenizer import (
    EOD_TOKEN,
    PAD_TOKEN,
    ByteLevelTokenizer,
    CharLevelTokenizer,
    HFTokenizer,
    TokenizerError,
    build_tokenizer,
    train_bpe_tokenizer,
)
from tests.conftest import REPO_ROOT

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Pack my box with five dozen liquor jugs!",
    "Ünïcödé text, emoji 🦊 and tabs\tare bytes too.",
] * 20
SAMPLES = ["hello world", "def f(x):\n\treturn x * 2", "naïve café 🦊", "", "  leading spaces"]


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    return train_bpe_tokenizer(LINES, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=300)


def test_bpe_round_trip_and_special_tokens(bpe_file):
    tokenizer = build_tokenizer(SimpleNamespace(tokenizer_type="HFTokenizer", vocab_file=str(bpe_file)))
    assert isinstance(tokenizer, HFTokenizer)
    vocab = json.loads(bpe_file.read_text())["model"]["vocab"]
    assert tokenizer.eod == vocab[EOD_TOKEN] and tokenizer.pad == vocab[PAD_TOKEN] and tokenizer.eod != tokenizer.pad
    assert 258 <= tokenizer.vocab_size <= 300
    for text in SAMPLES:
        ids = tokenizer.tokenize(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids) == text
    # Merges were learned: frequent training text takes fewer tokens than bytes.
    assert len(tokenizer.tokenize(LINES[0])) < 0.75 * len(LINES[0].encode())
    assert tokenizer.tokenize_batch(SAMPLES) == [tokenizer.tokenize(t) for t in SAMPLES]


@pytest.mark.parametrize("cls", [ByteLevelTokenizer, CharLevelTokenizer])
def test_byte_tokenizers_round_trip(cls):
    tokenizer = cls()
    for text in SAMPLES:
        ids = tokenizer.tokenize(text)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.detokenize(ids + [tokenizer.eod]) == text
    assert max(tokenizer.eod, tokenizer.pad) < tokenizer.vocab_size


def test_byte_level_special_ids_outside_bytes():
    tokenizer = build_tokenizer(SimpleNamespace(tokenizer_type="ByteLevelTokenizer", vocab_file=None))
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (258, 256, 257)


def test_missing_vocab_file_names_path_and_setting(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(TokenizerError, match="vocab_file.*nope.json"):
        build_tokenizer(SimpleNamespace(tokenizer_type="HFTokenizer", vocab_file=str(missing)))
    with pytest.raises(TokenizerError, match="needs vocab_file"):
        build_tokenizer(SimpleNamespace(tokenizer_type="HFTokenizer", vocab_file=None))


def test_unreadable_vocab_file_is_clear(tmp_path):
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a readable"):
        HFTokenizer(garbage)


def test_train_tokenizer_cli(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(LINES))
    output = tmp_path / "out" / "tokenizer.json"
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools/datasets/train_tokenizer.py"), "--input", str(corpus),
         "--output", str(output), "--vocab-size", "280"],
        check=True, capture_output=True, text=True,
    )
    tokenizer = HFTokenizer(output)
    assert tokenizer.vocab_size == 280
    assert tokenizer.detokenize(tokenizer.tokenize(LINES[1])) == LINES[1]
