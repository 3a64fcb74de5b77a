"""The mmap indexed dataset (.bin/.idx): byte layout, round trips, GPT-NeoX dtype codes, clear errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from megatron.data import DataError, MMapIndexedDataset, MMapIndexedDatasetBuilder, best_fitting_dtype

# The format as GPT-NeoX/Megatron document it, written out independently of the code under test.
MAGIC = b"MMIDIDX\x00\x00"
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float32: 6, np.float64: 7, np.uint16: 8}


def hand_built_index(code: int, sizes: list[int], itemsize: int, doc_idx: list[int]) -> bytes:
    pointers, address = [], 0
    for size in sizes:
        pointers.append(address)
        address += size * itemsize
    return (
        MAGIC
        + struct.pack("<Q", 1)
        + struct.pack("<B", code)
        + struct.pack("<q", len(sizes))
        + struct.pack("<q", len(doc_idx))
        + struct.pack(f"<{len(sizes)}i", *sizes)
        + struct.pack(f"<{len(pointers)}q", *pointers)
        + struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    )


def write(prefix, dtype, documents: list[list[np.ndarray]]) -> None:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def test_header_bytes_exactly_as_the_format_says(tmp_path):
    prefix = tmp_path / "d"
    write(prefix, np.uint16, [[np.array([5, 6, 7])], [np.array([], dtype=np.int64), np.array([65000, 1])]])
    assert (tmp_path / "d.idx").read_bytes() == hand_built_index(8, [3, 0, 2], 2, [0, 1, 3])
    assert (tmp_path / "d.bin").read_bytes() == struct.pack("<5H", 5, 6, 7, 65000, 1)


@pytest.mark.parametrize("dtype", list(CODES))
def test_writer_reader_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(CODES[dtype])
    high = 100 if np.dtype(dtype).itemsize == 1 else 30000
    documents = [[rng.integers(0, high, size=rng.integers(0, 40)).astype(dtype)
                  for _ in range(rng.integers(1, 4))] for _ in range(25)]
    write(tmp_path / "d", dtype, documents)
    sequences = [s for document in documents for s in document]
    data = MMapIndexedDataset(tmp_path / "d")
    assert data.dtype == np.dtype(dtype)
    assert len(data) == len(sequences)
    assert data.sizes.tolist() == [len(s) for s in sequences]
    assert data.doc_idx.tolist() == np.cumsum([0] + [len(d) for d in documents]).tolist()
    for i, sequence in enumerate(sequences):
        np.testing.assert_array_equal(data[i], sequence)
    longest = int(np.argmax(data.sizes))
    np.testing.assert_array_equal(data.get(longest, 3, 5), sequences[longest][3:8])
    np.testing.assert_array_equal(data.get(longest, 4), sequences[longest][4:])
    assert (tmp_path / "d.idx").read_bytes()[17] == CODES[dtype]


def test_reads_a_hand_built_dataset(tmp_path):
    (tmp_path / "h.idx").write_bytes(hand_built_index(4, [2, 3], 4, [0, 2]))
    (tmp_path / "h.bin").write_bytes(struct.pack("<5i", -1, 70000, 3, 4, 5))
    data = MMapIndexedDataset(tmp_path / "h")
    assert data.dtype == np.int32
    assert data[0].tolist() == [-1, 70000] and data[1].tolist() == [3, 4, 5]


@pytest.mark.parametrize("code", [6, 7])
@pytest.mark.parametrize(("itemsize", "expected"), [(8, np.float64), (4, np.float32)])
def test_float_codes_settled_by_data_size(tmp_path, code, itemsize, expected):
    """GPT-NeoX reads 6 as float32 and 7 as float64, Megatron-core the other way round."""
    (tmp_path / "f.idx").write_bytes(hand_built_index(code, [3], itemsize, [0, 1]))
    values = np.array([0.5, -2.0, 3.25], dtype=expected)
    (tmp_path / "f.bin").write_bytes(values.tobytes())
    data = MMapIndexedDataset(tmp_path / "f")
    assert data.dtype == np.dtype(expected)
    np.testing.assert_array_equal(data[0], values)


def test_merge_file(tmp_path):
    write(tmp_path / "a", np.uint16, [[np.array([1, 2])], [np.array([3])]])
    write(tmp_path / "b", np.uint16, [[np.array([4, 5, 6]), np.array([7])]])
    builder = MMapIndexedDatasetBuilder(tmp_path / "m.bin", np.uint16)
    builder.merge_file_(tmp_path / "a")
    builder.merge_file_(tmp_path / "b")
    builder.finalize(tmp_path / "m.idx")
    merged = MMapIndexedDataset(tmp_path / "m")
    assert [merged[i].tolist() for i in range(len(merged))] == [[1, 2], [3], [4, 5, 6], [7]]
    assert merged.doc_idx.tolist() == [0, 1, 2, 4]


def test_best_fitting_dtype():
    assert best_fitting_dtype(50277) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(None) == np.int32


def test_token_ids_too_large_for_dtype_are_refused(tmp_path):
    builder = MMapIndexedDatasetBuilder(tmp_path / "x.bin", np.uint16)
    with pytest.raises(DataError, match="do not fit uint16"):
        builder.add_item(np.array([1, 70000]))


def test_missing_files_name_prefix_and_setting(tmp_path):
    write(tmp_path / "d", np.uint16, [[np.array([1])]])
    (tmp_path / "d.bin").unlink()
    with pytest.raises(DataError, match=r"train_data_paths\[0\].*d'.*d\.bin"):
        MMapIndexedDataset(tmp_path / "d", setting="train_data_paths[0]")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b"NOTANIDX\x00" + b[9:], "does not start with"),
        (lambda b: b[:20], "truncated"),
        (lambda b: b[:-8], "corrupt"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version 2"),
        (lambda b: b[:17] + bytes([42]) + b[18:], "unknown dtype code 42"),
    ],
)
def test_corrupt_index_is_a_data_error(tmp_path, damage, message):
    write(tmp_path / "d", np.uint16, [[np.array([1, 2, 3])], [np.array([4])]])
    index = tmp_path / "d.idx"
    index.write_bytes(damage(index.read_bytes()))
    with pytest.raises(DataError, match=message):
        MMapIndexedDataset(tmp_path / "d")


def test_bin_not_matching_index_is_a_data_error(tmp_path):
    write(tmp_path / "d", np.uint16, [[np.array([1, 2, 3])]])
    (tmp_path / "d.bin").write_bytes(b"\x00" * 4)
    with pytest.raises(DataError, match="do not belong together"):
        MMapIndexedDataset(tmp_path / "d")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_interoperates_with_megatron_core(tmp_path, dtype):
    """Megatron-core's reader and writer (installed, independent code) agree with ours in both directions."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(7)
    documents = [[rng.integers(0, 60000, size=rng.integers(0, 30)) for _ in range(rng.integers(1, 3))]
                 for _ in range(12)]
    sequences = [s for document in documents for s in document]
    doc_idx = np.cumsum([0] + [len(d) for d in documents]).tolist()

    write(tmp_path / "ours", dtype, documents)
    theirs_reading_ours = IndexedDataset(str(tmp_path / "ours"), mmap=True)
    assert theirs_reading_ours.document_indices.tolist() == doc_idx
    assert [theirs_reading_ours[i].tolist() for i in range(len(sequences))] == [s.tolist() for s in sequences]

    builder = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(torch.from_numpy(sequence))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    ours_reading_theirs = MMapIndexedDataset(tmp_path / "theirs")
    assert ours_reading_theirs.dtype == np.dtype(dtype)
    assert ours_reading_theirs.doc_idx.tolist() == doc_idx
    assert [ours_reading_theirs[i].tolist() for i in range(len(sequences))] == [s.tolist() for s in sequences]
    assert (tmp_path / "theirs.idx").read_bytes() == (tmp_path / "ours.idx").read_bytes()
