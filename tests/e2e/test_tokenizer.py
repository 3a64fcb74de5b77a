"""Tokenizers: round trips through tokenizers trained here (a tokenizers JSON, GPT-2's vocab.json +
merges.txt, a sentencepiece model), the byte-level ones, errors that name the setting."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import sentencepiece
from tokenizers import Tokenizer as LibraryTokenizer

from megatron.tokenizer import (
    EOD_TOKEN,
    PAD_TOKEN,
    ByteLevelTokenizer,
    CharLevelTokenizer,
    GPT2BPETokenizer,
    HFTokenizer,
    SPMTokenizer,
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


def settings(tokenizer_type, vocab_file=None, merge_file=None):
    return SimpleNamespace(tokenizer_type=tokenizer_type, vocab_file=vocab_file, merge_file=merge_file)


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    return train_bpe_tokenizer(LINES, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=300)


def test_bpe_round_trip_and_special_tokens(bpe_file):
    tokenizer = build_tokenizer(settings("HFTokenizer", str(bpe_file)))
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


@pytest.fixture(scope="module")
def gpt2_files(bpe_file):
    """GPT-2's two files, vocab.json and merges.txt, of the BPE trained above."""
    vocab, merges = LibraryTokenizer.from_file(str(bpe_file)).model.save(str(bpe_file.parent))
    return vocab, merges


def test_gpt2_bpe_from_vocab_and_merges_matches_transformers(gpt2_files):
    transformers = pytest.importorskip("transformers")
    vocab, merges = gpt2_files
    tokenizer = build_tokenizer(settings("gpt2bpetokenizer", vocab, merges))  # GPT-NeoX ignores case
    assert isinstance(tokenizer, GPT2BPETokenizer)
    entries = json.loads(open(vocab).read())
    assert tokenizer.vocab_size == len(entries) and tokenizer.eod == entries[EOD_TOKEN]
    reference = transformers.GPT2Tokenizer(vocab, merges, errors="replace")  # what GPT-NeoX builds
    for text in SAMPLES + LINES[:4] + [f"one document{EOD_TOKEN}the next"]:
        ids = tokenizer.tokenize(text)
        assert ids == reference.encode(text)
        assert tokenizer.detokenize(ids) == text
    assert tokenizer.tokenize(f"a{EOD_TOKEN}b")[1] == tokenizer.eod
    assert len(tokenizer.tokenize(LINES[0])) < 0.75 * len(LINES[0].encode())
    assert tokenizer.tokenize_batch(SAMPLES) == [tokenizer.tokenize(t) for t in SAMPLES]


def test_gpt2_bpe_needs_both_files_and_the_end_of_document_token(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    with pytest.raises(TokenizerError, match="GPT2BPETokenizer needs merge_file"):
        build_tokenizer(settings("GPT2BPETokenizer", vocab))
    with pytest.raises(TokenizerError, match="merge_file .*absent.txt.*does not exist"):
        build_tokenizer(settings("GPT2BPETokenizer", vocab, str(tmp_path / "absent.txt")))
    (tmp_path / "broken.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="broken.json.*not a GPT-2 vocab.json"):
        GPT2BPETokenizer(tmp_path / "broken.json", merges)
    entries = json.loads(open(vocab).read())
    del entries[EOD_TOKEN]
    (tmp_path / "no_eod.json").write_text(json.dumps(entries))
    with pytest.raises(TokenizerError, match="no_eod.json.*has no '<|endoftext|>' token"):
        GPT2BPETokenizer(tmp_path / "no_eod.json", merges)


def train_sentencepiece(path, user_defined_symbols):
    """A real sentencepiece BPE model; identity normalisation and byte fallback make every text round-trip."""
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES), model_prefix=str(path.with_suffix("")), vocab_size=360, model_type="bpe",
        user_defined_symbols=user_defined_symbols, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2,
    )
    return path


def test_sentencepiece_round_trip_and_end_of_document(tmp_path):
    model = train_sentencepiece(tmp_path / "tokenizer.model", [EOD_TOKEN])
    tokenizer = build_tokenizer(settings("SPMTokenizer", str(model)))
    assert isinstance(tokenizer, SPMTokenizer)
    oracle = sentencepiece.SentencePieceProcessor(model_file=str(model))
    assert tokenizer.vocab_size == 360
    assert oracle.id_to_piece(tokenizer.eod) == EOD_TOKEN
    for text in SAMPLES + LINES[:4]:
        ids = tokenizer.tokenize(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids) == text
    assert len(tokenizer.tokenize(LINES[0])) < 0.75 * len(LINES[0].encode())
    assert tokenizer.tokenize_batch(SAMPLES) == [tokenizer.tokenize(t) for t in SAMPLES]


def test_sentencepiece_without_end_of_document_piece_ends_documents_with_unknown_as_gpt_neox(tmp_path):
    model = train_sentencepiece(tmp_path / "llama_like.model", [])
    tokenizer = SPMTokenizer(model)
    assert tokenizer.eod == sentencepiece.SentencePieceProcessor(model_file=str(model)).unk_id()


def test_sentencepiece_unreadable_model_is_clear(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="tokenizer.model.*not a readable sentencepiece model"):
        build_tokenizer(settings("SPMTokenizer", str(tmp_path / "tokenizer.model")))
    with pytest.raises(TokenizerError, match="SPMTokenizer needs vocab_file"):
        build_tokenizer(settings("SPMTokenizer"))


@pytest.mark.parametrize("cls", [ByteLevelTokenizer, CharLevelTokenizer])
def test_byte_tokenizers_round_trip(cls):
    tokenizer = cls()
    for text in SAMPLES:
        ids = tokenizer.tokenize(text)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.detokenize(ids + [tokenizer.eod]) == text
    assert max(tokenizer.eod, tokenizer.pad) < tokenizer.vocab_size


def test_byte_level_special_ids_outside_bytes():
    tokenizer = build_tokenizer(settings("ByteLevelTokenizer"))
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (258, 256, 257)


def test_char_level_ids_as_gpt_neox():
    tokenizer = build_tokenizer(settings("CharLevelTokenizer"))
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (512, 0, 1)


def test_unknown_type_lists_the_known_ones():
    with pytest.raises(TokenizerError, match="'WordPiece' is unknown; use one of GPT2BPETokenizer, HFTokenizer"):
        build_tokenizer(settings("WordPiece"))


def test_missing_vocab_file_names_path_and_setting(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(TokenizerError, match="vocab_file.*nope.json"):
        build_tokenizer(settings("HFTokenizer", str(missing)))
    with pytest.raises(TokenizerError, match="HFTokenizer needs vocab_file"):
        build_tokenizer(settings("HFTokenizer"))


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


def test_a_tokenizer_without_endoftext_ends_documents_with_its_folders_eos_token_as_llama_3s_does(tmp_path):
    from tokenizers import Tokenizer as LibraryTokenizer
    from tokenizers import models, pre_tokenizers

    library = LibraryTokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    library.pre_tokenizer = pre_tokenizers.Whitespace()
    library.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    library.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="has no '<|endoftext|>' token.*tokenizer_config.json naming the eos_token"):
        HFTokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|end_of_text|>"}}))
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
    assert tokenizer.eod == library.token_to_id("<|end_of_text|>") == 4
    assert tokenizer.tokenize("hello world<|end_of_text|>") == [0, 1, 4]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(TokenizerError, match="has no '<|eot_id|>' token"):
        HFTokenizer(tmp_path / "tokenizer.json")
