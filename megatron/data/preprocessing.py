"""Tokenize documents into mmap indexed datasets: `{output_prefix}_{key}_document.bin/.idx` per key."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from megatron.data.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.tokenizer import Tokenizer, build_tokenizer


@dataclass(frozen=True)
class TokenizerSpec:
    """Plain values a worker process rebuilds its tokenizer from."""

    tokenizer_type: str
    vocab_file: str | None = None


@dataclass
class PreprocessResult:
    prefixes: dict[str, str]
    documents: int
    tokens: int
    seconds: float


_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(spec)


def _encode(job: tuple[dict[str, str], bool]) -> dict[str, list[int]]:
    document, append_eod = job
    encoded = {}
    for key, text in document.items():
        ids = _worker_tokenizer.tokenize(text) if text else []
        if ids and append_eod:
            ids.append(_worker_tokenizer.eod)
        encoded[key] = ids
    return encoded


def output_prefix_for(output_prefix: str | Path, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def tokenize_to_indexed_datasets(
    documents: Iterable[dict[str, str]],
    output_prefix: str | Path,
    keys: list[str],
    spec: TokenizerSpec,
    append_eod: bool = True,
    workers: int = 1,
    chunksize: int = 32,
    progress: bool = False,
    log_interval: int = 100,
) -> PreprocessResult:
    """Tokenize every document (one sequence per document, empty ones skipped) with `workers` processes."""
    from tqdm import tqdm

    tokenizer = build_tokenizer(spec)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix_for(output_prefix, key) for key in keys}
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builders = {key: MMapIndexedDatasetBuilder(data_file_path(prefix), dtype) for key, prefix in prefixes.items()}
    jobs = ((document, append_eod) for document in documents)
    pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(spec,)) if workers > 1 else None
    if pool is None:
        _init_worker(spec)
    encoded_stream = pool.imap(_encode, jobs, chunksize) if pool else map(_encode, jobs)
    start = time.perf_counter()
    documents_done = tokens_done = 0
    bar = tqdm(unit="doc", disable=not progress, mininterval=0.5)
    try:
        for encoded in encoded_stream:
            for key, ids in encoded.items():
                if ids:
                    builders[key].add_item(ids)
                    builders[key].end_document()
                tokens_done += len(ids)
            documents_done += 1
            bar.update(1)
            if documents_done % log_interval == 0:
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(docs_per_s=f"{documents_done / elapsed:.0f}", tokens_per_s=f"{tokens_done / elapsed:.0f}")
    finally:
        bar.close()
        if pool:
            pool.terminate()  # every result has been consumed, or an error ends the run
            pool.join()
    for key, prefix in prefixes.items():
        builders[key].finalize(index_file_path(prefix))
    return PreprocessResult(prefixes, documents_done, tokens_done, time.perf_counter() - start)
