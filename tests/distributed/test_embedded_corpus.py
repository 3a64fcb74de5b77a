"""The embedded corpus: built from the stdlib once, cached, safe when ranks race, usable for training."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer

from megatron.data import MMapIndexedDataset
from megatron.data.embedded_corpus import ensure_embedded_corpus, stdlib_source_files
from tests.conftest import REPO_ROOT

SMALL = dict(max_files=25, vocab_size=400)


@pytest.fixture(scope="module")
def default_corpus(tmp_path_factory):
    """The corpus exactly as training builds it (default size and vocabulary), built once for this module."""
    cache = tmp_path_factory.mktemp("embedded")
    return cache, ensure_embedded_corpus(cache)


def test_default_corpus_is_a_usable_training_corpus(default_corpus):
    _, corpus = default_corpus
    tokenizer = RustTokenizer.from_file(corpus.vocab_file)
    assert tokenizer.get_vocab_size() == 4096
    eod = tokenizer.token_to_id("<|endoftext|>")
    data = MMapIndexedDataset(corpus.data_prefix)
    assert data.dtype == np.uint16
    total_tokens = int(data.sizes.sum())
    assert 300_000 < total_tokens < 3_000_000, total_tokens  # a few MB of source: enough for a 1-5M model
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in stdlib_source_files(3_000_000) if f.read_text(encoding="utf-8", errors="replace")]
    assert len(data) == len(files) > 50
    for i in (0, len(files) // 2, len(files) - 1):  # one document per file, ended by eod
        ids = data[i].tolist()
        assert ids[-1] == eod and eod not in ids[:-1]
        assert tokenizer.decode(ids[:-1]) == files[i].read_text(encoding="utf-8", errors="replace")
    for f in files:
        parts = f.relative_to(stdlib).parts
        assert "test" not in parts and "tests" not in parts and "site-packages" not in parts


def test_second_call_reuses_the_corpus_and_cli_prints_it(default_corpus):
    cache, corpus = default_corpus
    stamps = {p: p.stat().st_mtime_ns for p in Path(corpus.data_prefix).parent.iterdir()}
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools/datasets/build_embedded_corpus.py"), "--cache-dir", str(cache)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert f"data_path: {corpus.data_prefix}" in result.stdout and f"vocab_file: {corpus.vocab_file}" in result.stdout
    assert {p: p.stat().st_mtime_ns for p in Path(corpus.data_prefix).parent.iterdir()} == stamps
    assert ensure_embedded_corpus(cache) == corpus


def test_concurrent_builders_agree(tmp_path):
    code = ("import sys; from megatron.data.embedded_corpus import ensure_embedded_corpus; "
            f"c = ensure_embedded_corpus(sys.argv[1], max_files={SMALL['max_files']}, vocab_size={SMALL['vocab_size']}); "
            "print(c.data_prefix, c.vocab_file)")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    racers = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outputs = [racer.communicate(timeout=180) for racer in racers]
    assert all(racer.returncode == 0 for racer in racers), [err for _, err in outputs]
    # The racer that builds says so first; the one that waited for it only prints the answer.
    answers = [out.splitlines()[-1] for out, _ in outputs]
    assert answers[0] == answers[1]
    assert [p.name for p in tmp_path.iterdir()] == [Path(answers[0].split()[0]).parent.name]  # no leftovers
    data = MMapIndexedDataset(answers[0].split()[0])
    assert len(data) > 0


def test_default_location_follows_neox_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NEOX_CACHE_DIR", str(tmp_path))
    corpus = ensure_embedded_corpus(**SMALL)
    assert Path(corpus.data_prefix).parent.parent == tmp_path / "embedded_corpus"
    assert Path(corpus.vocab_file).is_file()


def test_losing_the_rename_race_keeps_the_winners_corpus(tmp_path, monkeypatch):
    import megatron.data.embedded_corpus as module

    winner = ensure_embedded_corpus(tmp_path, **SMALL)
    stamp = Path(winner.data_prefix + ".bin").stat().st_mtime_ns
    # A rank that checked before the winner renamed its build into place: it builds too, then loses.
    monkeypatch.setattr(module, "dataset_exists", lambda prefix: False)
    loser = ensure_embedded_corpus(tmp_path, **SMALL)
    assert loser == winner
    assert Path(winner.data_prefix + ".bin").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [Path(winner.data_prefix).parent.name]


def test_the_corpus_files_are_every_stdlib_source_outside_tests_and_installed_packages_in_path_order():
    root = Path(sysconfig.get_paths()["stdlib"])
    left_out = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    expected = sorted((p for p in root.rglob("*.py") if p.is_file() and not left_out & set(p.relative_to(root).parts[:-1])),
                      key=lambda p: p.relative_to(root).as_posix())
    assert stdlib_source_files(max_bytes=10**12) == expected
    first = stdlib_source_files(max_bytes=3_000_000)
    assert first == expected[:len(first)] and sum(p.stat().st_size for p in first) <= 3_000_000
