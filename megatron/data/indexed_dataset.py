"""The Megatron / GPT-NeoX mmap indexed dataset: token ids in `<prefix>.bin`, an index in `<prefix>.idx`.

Index layout (little endian):
    magic b"MMIDIDX\\x00\\x00" | version uint64 = 1 | dtype code uint8 |
    number of sequences int64 | number of doc_idx entries int64 |
    sizes int32[sequences] | pointers int64[sequences] (byte offsets into .bin) | doc_idx int64[entries]
doc_idx holds the first sequence of every document plus a final entry equal to the sequence count.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import numpy as np

from megatron.data.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBqq")

# The integer codes mean the same to GPT-NeoX and Megatron-core; the float ones do not: GPT-NeoX reads 6 as
# float32 and 7 as float64 (older releases both as float64), Megatron-core 6 as float64 and 7 as float32. The
# reader settles 6 and 7 from the .bin size; the writer uses GPT-NeoX's codes, whose tools read float files
# (precomputed reference log-probabilities).
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float32),
    7: np.dtype(np.float64),
    8: np.dtype(np.uint16),
}
_FLOAT_CODES = (6, 7)
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}


def index_file_path(prefix: str | Path) -> str:
    return f"{prefix}.idx"


def data_file_path(prefix: str | Path) -> str:
    return f"{prefix}.bin"


def best_fitting_dtype(vocab_size: int | None) -> np.dtype:
    """uint16 when every id fits (vocab below 65500, as GPT-NeoX decides), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF_DTYPE:
        raise DataError(f"dtype {dtype} cannot be stored in an mmap indexed dataset; use one of "
                        f"{sorted(str(d) for d in _CODE_OF_DTYPE)}")
    return _CODE_OF_DTYPE[dtype]


def dataset_exists(prefix: str | Path) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def write_index(idx_path: str | Path, dtype, sizes, doc_idx) -> None:
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(idx_path, "wb") as stream:
        stream.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, dtype_code(dtype), len(sizes), len(doc_idx)))
        stream.write(sizes.tobytes(order="C"))
        stream.write(pointers.tobytes(order="C"))
        stream.write(doc_idx.tobytes(order="C"))


class _Index:
    """The parsed .idx file; arrays are views into one read-only memory map."""

    def __init__(self, idx_path: str, bin_size: int):
        try:
            with open(idx_path, "rb") as stream:
                header = stream.read(_HEADER.size)
        except OSError as err:
            raise DataError(f"cannot read index file {idx_path!r}: {err}") from err
        if len(header) < _HEADER.size:
            raise DataError(f"index file {idx_path!r} is truncated: {len(header)} bytes, the header alone "
                            f"needs {_HEADER.size}; rebuild it with tools/datasets/preprocess_data.py")
        magic, version, code, num_sequences, num_doc_idx = _HEADER.unpack(header)
        if magic != INDEX_MAGIC:
            raise DataError(f"index file {idx_path!r} does not start with {INDEX_MAGIC!r} (found {magic!r}); "
                            "it is not an mmap indexed dataset (data_impl: mmap)")
        if version != INDEX_VERSION:
            raise DataError(f"index file {idx_path!r} has version {version}; only version {INDEX_VERSION} is known")
        if code not in DTYPE_CODES:
            raise DataError(f"index file {idx_path!r} has unknown dtype code {code}; known: {sorted(DTYPE_CODES)}")
        expected = _HEADER.size + num_sequences * (4 + 8) + num_doc_idx * 8
        actual = os.path.getsize(idx_path)
        if num_sequences < 0 or num_doc_idx < 0 or actual != expected:
            raise DataError(f"index file {idx_path!r} is corrupt: its header announces {num_sequences} "
                            f"sequences and {num_doc_idx} documents ({expected} bytes) but it has {actual} bytes")
        buffer = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sizes = np.frombuffer(buffer, dtype=np.int32, count=num_sequences, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(buffer, dtype=np.int64, count=num_sequences, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(buffer, dtype=np.int64, count=num_doc_idx, offset=offset)
        self.dtype = self._resolve_dtype(code, bin_size, idx_path)

    def _resolve_dtype(self, code: int, bin_size: int, idx_path: str) -> np.dtype:
        dtype = DTYPE_CODES[code]
        total_tokens = int(self.sizes.sum(dtype=np.int64))
        if code in _FLOAT_CODES and total_tokens:
            dtype = {4: np.dtype(np.float32), 8: np.dtype(np.float64)}.get(bin_size // total_tokens, dtype)
        if bin_size != total_tokens * dtype.itemsize:
            raise DataError(f"data file next to {idx_path!r} has {bin_size} bytes but the index describes "
                            f"{total_tokens} tokens of {dtype} ({total_tokens * dtype.itemsize} bytes); "
                            "the .bin and .idx do not belong together, rebuild them")
        return dtype


class MMapIndexedDataset:
    """Read-only view of `<prefix>.bin`/`<prefix>.idx`; item i is sequence i as a numpy array."""

    def __init__(self, prefix: str | Path, setting: str = "data_path"):
        self.prefix = str(prefix)
        for path in (data_file_path(self.prefix), index_file_path(self.prefix)):
            if not os.path.isfile(path):
                raise DataError(f"{setting} points at dataset prefix {self.prefix!r} but {path!r} does not "
                                "exist; give the prefix without .bin/.idx (tools/datasets/preprocess_data.py "
                                "writes <output-prefix>_text_document.bin/.idx)")
        bin_path = data_file_path(self.prefix)
        self._index = _Index(index_file_path(self.prefix), os.path.getsize(bin_path))
        self._data = np.memmap(bin_path, mode="r", dtype=np.uint8) if self._index.sizes.sum() else np.zeros(0, np.uint8)

    def __getstate__(self):
        return self.prefix

    def __setstate__(self, prefix: str):
        self.__init__(prefix)

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    @property
    def doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    def __len__(self) -> int:
        return len(self._index.sizes)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def values(self) -> np.ndarray:
        """Every value of the .bin, all sequences one after the other, as one read-only array (memory-mapped)."""
        return np.frombuffer(self._data, dtype=self.dtype)

    def id_range(self, chunk: int = 1 << 26) -> tuple[int, int]:
        """(smallest, largest) id in the .bin ((0, -1) when empty), read `chunk` tokens at a time."""
        tokens = self.values()
        chunks = [tokens[start:start + chunk] for start in range(0, len(tokens), chunk)]
        return (min((int(part.min()) for part in chunks), default=0),
                max((int(part.max()) for part in chunks), default=-1))

    def first_id_outside(self, low: int | None, high: int, chunk: int = 1 << 26) -> tuple[int, int, int] | None:
        """(sequence, position in it, id) of the first id below `low` (None: no lower bound) or at least `high`,
        or None; read `chunk` tokens at a time."""
        tokens = self.values()
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            outside = np.flatnonzero((part >= high) | (part < low) if low is not None else part >= high)
            if outside.size:
                at = start + int(outside[0])
                starts = self._index.pointers // self.dtype.itemsize
                sequence = int(np.searchsorted(starts, at, side="right")) - 1
                return sequence, at - int(starts[sequence]), int(tokens[at])
        return None

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens offset .. offset+length of sequence idx (to its end when length is None)."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {self.prefix!r} with {len(self)} sequences")
        size = int(self._index.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens {offset}..{offset + length} out of range for sequence {idx} of "
                             f"{size} tokens in {self.prefix!r}")
        start = int(self._index.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._data, dtype=self.dtype, count=length, offset=start)


class MMapIndexedDatasetBuilder:
    """Append sequences to a .bin file; finalize() writes the matching .idx."""

    def __init__(self, bin_path: str | Path, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self._bin_path = str(bin_path)
        self._file = open(self._bin_path, "wb")  # noqa: SIM115 - closed by finalize()
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]
        self.max_token_id = -1  # the largest id added so far; -1 while there is none

    def add_item(self, tokens) -> None:
        array = np.asarray(tokens.numpy() if hasattr(tokens, "numpy") else tokens)
        if array.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            smallest, largest = int(array.min()), int(array.max())
            if smallest < info.min or largest > info.max:
                raise DataError(f"token ids {smallest}..{largest} do not fit {self.dtype} in "
                                f"{self._bin_path!r}; choose the dtype by vocabulary size (best_fitting_dtype)")
            self.max_token_id = max(self.max_token_id, largest)
        self._file.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(array.size)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, prefix: str | Path) -> None:
        """Append every sequence and document of another dataset of the same dtype."""
        other = MMapIndexedDataset(prefix, setting="merge_file_")
        if other.dtype != self.dtype:
            raise DataError(f"cannot merge {str(prefix)!r} ({other.dtype}) into {self._bin_path!r} ({self.dtype})")
        first = len(self._sizes)
        self.max_token_id = max(self.max_token_id, other.id_range()[1])
        self._sizes.extend(int(s) for s in other.sizes)
        self._doc_idx.extend(first + int(d) for d in other.doc_idx[1:])
        with open(data_file_path(prefix), "rb") as source:
            shutil.copyfileobj(source, self._file)

    def finalize(self, idx_path: str | Path) -> None:
        self._file.close()
        write_index(idx_path, self.dtype, self._sizes, self._doc_idx)
