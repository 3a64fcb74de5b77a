"""Tokenize documents into mmap indexed datasets: `{output_prefix}_{key}_document.bin/.idx` per key.

`encode_into_builders` is the worker pool and writer loop every preprocessing tool shares."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.data.data_vocabulary import write_vocabulary_record
from megatron.data.errors import DataError
from megatron.data.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.fsio import replaced_on_success
from megatron.tokenizer import Tokenizer, TokenizerSpec, build_tokenizer


@dataclass
class PreprocessResult:
    prefixes: dict[str, str]
    documents: int
    tokens: int
    seconds: float

    def summary(self, unit: str) -> str:
        """What the tools print when they are done: counts, rate, and each key's output prefix."""
        rate = self.tokens / max(self.seconds, 1e-9)
        lines = [f"{self.documents} {unit}, {self.tokens} tokens in {self.seconds:.1f} s ({rate:.0f} tokens/s)"]
        return "\n".join(lines + [f"{key}: {prefix}" for key, prefix in self.prefixes.items()])


_worker_tokenizer: Tokenizer | None = None


def _start_worker(initializer: Callable, initargs: tuple, in_pool: bool) -> None:
    if in_pool:  # the processes are the parallelism; keep the Rust tokenizer from starting threads in each
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    initializer(*initargs)


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(spec)


def _encode_chunk(job: tuple[list[dict[str, str]], bool]) -> list[dict[str, list[int]]]:
    documents, append_eod = job
    encoded: list[dict[str, list[int]]] = [{} for _ in documents]
    for key in documents[0] if documents else ():
        texts = [document[key] for document in documents]
        for slot, ids in zip(encoded, _worker_tokenizer.tokenize_batch(texts), strict=True):
            if ids and append_eod:
                ids.append(_worker_tokenizer.eod)
            slot[key] = ids
    return encoded


def chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def output_prefix_for(output_prefix: str | Path, key: str) -> str:
    return f"{output_prefix}_{key}_document"


@contextmanager
def staged_datasets(output_prefix: str | Path, prefixes: dict[str, str]) -> Iterator[dict[str, tuple[str, str]]]:
    """{name: (.bin, .idx) to write} for each of `prefixes` ({name: prefix}): temporary files that replace the
    prefix's files when the block completes. When it fails (a bad record), the files of an earlier run stay
    as they were and no temporary file is left."""
    paths = [path for prefix in prefixes.values() for path in (data_file_path(prefix), index_file_path(prefix))]
    folder = Path(output_prefix).parent
    with ExitStack() as stack:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            temporaries = [str(path) for path in stack.enter_context(replaced_on_success(paths))]
        except OSError as err:
            in_the_way = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
            reason = f"{in_the_way} is a file, not a folder" if in_the_way else err.strerror
            raise DataError(f"--output-prefix {output_prefix}: cannot write into {folder} ({reason}); choose a prefix "
                            "in a folder you can write") from None
        yield dict(zip(prefixes, zip(temporaries[0::2], temporaries[1::2], strict=True), strict=True))


def encode_into_builders(
    jobs: Iterable,
    encode_chunk: Callable[[Any], list[dict[str, Any]]],
    initializer: Callable,
    initargs: tuple,
    builders: dict[str, MMapIndexedDatasetBuilder],
    workers: int = 1,
    progress: bool = False,
    log_interval: int = 100,
    expected_documents: int | None = None,
    counted: Callable[[str], bool] = lambda name: True,
) -> tuple[int, int, float]:
    """Encode `jobs` (chunks of documents) with `workers` processes, keeping their order, and add each
    document's sequences ({builder name: ids}, empty ones skipped) to `builders`, one document each.

    Every process runs `initializer(*initargs)` first. Returns (documents, tokens in the `counted`
    builders, seconds)."""
    from tqdm import tqdm

    pool = (multiprocessing.Pool(workers, initializer=_start_worker, initargs=(initializer, initargs, True))
            if workers > 1 else None)
    if pool is None:
        _start_worker(initializer, initargs, in_pool=False)
    encoded_chunks = pool.imap(encode_chunk, jobs) if pool else map(encode_chunk, jobs)
    start = time.perf_counter()
    documents_done = tokens_done = 0
    bar = tqdm(total=expected_documents, unit="doc", disable=not progress, mininterval=0.5)
    try:
        for encoded in itertools.chain.from_iterable(encoded_chunks):
            for name, ids in encoded.items():
                if len(ids):
                    builders[name].add_item(ids)
                    builders[name].end_document()
                if counted(name):
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
    return documents_done, tokens_done, time.perf_counter() - start


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
    expected_documents: int | None = None,
) -> PreprocessResult:
    """Tokenize every document (one sequence per document, empty ones skipped) with `workers` processes,
    each encoding chunks of `chunksize` documents in one batch call."""
    tokenizer = build_tokenizer(spec)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix_for(output_prefix, key) for key in keys}
    with staged_datasets(output_prefix, prefixes) as staged:
        builders = {key: MMapIndexedDatasetBuilder(bin_path, dtype) for key, (bin_path, _) in staged.items()}
        jobs = ((chunk, append_eod) for chunk in chunks(documents, chunksize))
        documents_done, tokens_done, seconds = encode_into_builders(
            jobs, _encode_chunk, _init_worker, (spec,), builders, workers, progress, log_interval, expected_documents)
        for key, (_, idx_path) in staged.items():
            builders[key].finalize(idx_path)
    for key, prefix in prefixes.items():
        write_vocabulary_record(prefix, tokenizer.vocab_size, builders[key].max_token_id, spec.tokenizer_type)
    return PreprocessResult(prefixes, documents_done, tokens_done, seconds)
