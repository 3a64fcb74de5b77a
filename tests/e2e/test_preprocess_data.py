"""tools/datasets/preprocess_data.py run as a user runs it: jsonl and text in, GPT-NeoX .bin/.idx out."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer

from megatron.data import MMapIndexedDataset
from megatron.tokenizer import train_bpe_tokenizer
from tests.conftest import REPO_ROOT

TOOL = str(REPO_ROOT / "tools/datasets/preprocess_data.py")
RECORDS = [
    {"text": "import os\nprint(os.getcwd())\n", "title": "cwd"},
    {"text": "", "title": "an empty text is skipped"},
    {"text": "def square(x):\n    return x * x\n", "title": "square"},
    {"text": "Ünïcödé 🦊 survives", "title": ""},
] + [{"text": f"line {i}: " + "word " * (i % 7), "title": f"t{i}"} for i in range(40)]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    texts = [r["text"] + r["title"] for r in RECORDS]
    return train_bpe_tokenizer(texts * 3, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=320)


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120)


def test_jsonl_two_keys_two_workers(tmp_path, vocab_file):
    (tmp_path / "in").mkdir()
    halves = RECORDS[:20], RECORDS[20:]
    for i, half in enumerate(halves):
        (tmp_path / "in" / f"part{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in half))
    result = run_tool("--input", str(tmp_path / "in" / "*.jsonl"), "--output-prefix", str(tmp_path / "out" / "mydata"),
                      "--jsonl-keys", "text", "title", "--tokenizer-type", "HFTokenizer",
                      "--vocab-file", str(vocab_file), "--append-eod", "--workers", "2", "--log-interval", "5")
    assert result.returncode == 0, result.stderr
    oracle = RustTokenizer.from_file(str(vocab_file))
    eod = oracle.token_to_id("<|endoftext|>")
    for key in ("text", "title"):
        data = MMapIndexedDataset(tmp_path / "out" / f"mydata_{key}_document")
        expected = [oracle.encode(r[key]).ids + [eod] for r in RECORDS if r[key]]
        assert data.dtype == np.uint16
        assert len(data) == len(expected) and data.doc_idx.tolist() == list(range(len(expected) + 1))
        for i, ids in enumerate(expected):
            assert data[i].tolist() == ids
        assert f"mydata_{key}_document" in result.stdout
        # what the training run checks its tokenizer and vocabulary against
        record = json.loads((tmp_path / "out" / f"mydata_{key}_document.meta.json").read_text())
        assert record["vocab_size"] == oracle.get_vocab_size() == 320
        assert record["max_token_id"] == max(max(ids) for ids in expected)


def test_gpt2_bpe_with_gpt_neox_arguments(tmp_path, vocab_file):
    """GPT-NeoX's own command line: GPT-2's vocab.json and merges.txt through --vocab-file / --merge-file."""
    vocab, merges = RustTokenizer.from_file(str(vocab_file)).model.save(str(tmp_path))
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    result = run_tool("--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "gpt2"),
                      "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                      "--append-eod", "--num-docs", str(len(RECORDS)), "--dataset-impl", "mmap")
    assert result.returncode == 0, result.stderr
    oracle = RustTokenizer.from_file(str(vocab_file))  # the same merges, so the same ids
    eod = json.loads(open(vocab).read())["<|endoftext|>"]
    expected = [oracle.encode(r["text"]).ids + [eod] for r in RECORDS if r["text"]]
    data = MMapIndexedDataset(tmp_path / "gpt2_text_document")
    assert [data[i].tolist() for i in range(len(data))] == expected
    result = run_tool("--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"),
                      "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "preprocess_data.py: error: tokenizer_type GPT2BPETokenizer needs merge_file (GPT-2's merges.txt); "
        "set merge_file")


def test_plain_text_byte_level_without_eod(tmp_path):
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    files[0].write_text("first document\nstill the first")
    files[1].write_text("second ✓")
    result = run_tool("--input", ",".join(str(f) for f in files), "--output-prefix", str(tmp_path / "plain"),
                      "--tokenizer-type", "ByteLevelTokenizer")
    assert result.returncode == 0, result.stderr
    data = MMapIndexedDataset(tmp_path / "plain_text_document")
    assert [bytes(data[i].tolist()).decode() for i in range(len(data))] == [f.read_text() for f in files]


def test_errors_are_one_clear_line(tmp_path, vocab_file):
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "no text field"}) + "\n")
    result = run_tool("--input", str(tmp_path / "x.jsonl"), "--output-prefix", str(tmp_path / "o"),
                      "--tokenizer-type", "HFTokenizer", "--vocab-file", str(vocab_file))
    assert result.returncode != 0
    assert "x.jsonl:1 has no field 'text'" in result.stderr and "Traceback" not in result.stderr
    result = run_tool("--input", str(tmp_path / "none*.jsonl"), "--output-prefix", str(tmp_path / "o"),
                      "--tokenizer-type", "HFTokenizer", "--vocab-file", str(vocab_file))
    assert result.returncode != 0 and "matches no file" in result.stderr
