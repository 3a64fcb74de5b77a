"""A small training corpus that needs no download: the Python standard library's own source files.

Built once per cache directory: the sorted stdlib .py files (tests and site-packages left out, capped in
bytes), one document per file, a byte-level BPE tokenizer trained on them, and the tokenized .bin/.idx.
The build happens in a temporary directory that is renamed into place, so ranks that call this at the
same time each get a complete corpus (a loser of the rename race discards its copy).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron.data.index_cache import default_cache_root
from megatron.data.indexed_dataset import dataset_exists
from megatron.data.preprocessing import tokenize_to_indexed_datasets
from megatron.logging import slow_stage
from megatron.tokenizer import TokenizerSpec, train_bpe_tokenizer

CORPUS_FORMAT_VERSION = 1
EXCLUDED_DIRECTORIES = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
DATASET_NAME = "stdlib"
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class EmbeddedCorpus:
    data_prefix: str
    vocab_file: str


def stdlib_source_files(max_bytes: int, max_files: int | None = None) -> list[Path]:
    """Sorted stdlib .py files, stopping before the total would exceed max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen: list[Path] = []
    total = 0
    for path in _stdlib_python_files(root):
        size = path.stat().st_size
        if total + size > max_bytes or (max_files is not None and len(chosen) >= max_files):
            break
        chosen.append(path)
        total += size
    return chosen


def _stdlib_python_files(root: Path) -> list[Path]:
    """The .py files under `root` outside the excluded folders, by relative path. The excluded folders are
    not entered: site-packages alone holds tens of thousands of files, and every start asks for this list."""
    found: list[tuple[str, Path]] = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in EXCLUDED_DIRECTORIES]
        relative = Path(folder).relative_to(root)
        for name in names:
            path = Path(folder, name)
            if name.endswith(".py") and path.is_file():
                found.append(((relative / name).as_posix(), path))
    return [path for _, path in sorted(found)]


def _default_cache_dir() -> Path:
    return default_cache_root() / "embedded_corpus"


def _build(directory: Path, files: list[Path], vocab_size: int) -> None:
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in files]
    vocab_file = train_bpe_tokenizer(texts, directory / TOKENIZER_FILE, vocab_size=vocab_size)
    tokenize_to_indexed_datasets(
        ({"text": text} for text in texts),
        directory / DATASET_NAME,
        ["text"],
        TokenizerSpec("HFTokenizer", str(vocab_file)),
        append_eod=True,
    )


def ensure_embedded_corpus(
    cache_dir: str | Path | None = None,
    vocab_size: int = 4096,
    max_bytes: int = 3_000_000,
    max_files: int | None = None,
) -> EmbeddedCorpus:
    """The embedded corpus under cache_dir (default $NEOX_CACHE_DIR/embedded_corpus or
    ~/.cache/neox-warmstart/embedded_corpus), built first when it is not there yet."""
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    files = stdlib_source_files(max_bytes, max_files)
    recipe = {
        "version": CORPUS_FORMAT_VERSION,
        "python": sys.version_info[:2],
        "vocab_size": vocab_size,
        "files": [f"{p.name}:{p.stat().st_size}" for p in files],
    }
    key = hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:12]
    final = root / f"corpus-{key}"
    corpus = EmbeddedCorpus(str(final / f"{DATASET_NAME}_text_document"), str(final / TOKENIZER_FILE))
    if dataset_exists(corpus.data_prefix) and os.path.isfile(corpus.vocab_file):
        return corpus
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        with slow_stage(f"building the embedded corpus and training its tokenizer in {root} (first run only)"):
            _build(staging, files, vocab_size)
        (staging / "recipe.json").write_text(json.dumps(recipe, indent=1))
        staging.chmod(0o755)  # mkdtemp makes it private; the corpus is meant to be shared
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return corpus
