"""Cache of built sample indices: .npy files named by a hash of the settings, valid while the data is unchanged.

The files go next to the data when that directory is writable, else under a cache directory. Every file
is written to a temporary name and renamed, and the metadata file goes last, so ranks building the same
(deterministic) index at once never read a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megatron.data.indexed_dataset import data_file_path, index_file_path
from megatron.fsio import write_atomically
from megatron.logging import slow_stage


def default_cache_root() -> Path:
    root = os.environ.get("NEOX_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "neox-warmstart"


def data_fingerprint(prefix: str) -> dict[str, list[int]]:
    """Size and modification time of the .bin and .idx: a change of either invalidates built indices."""
    fingerprint = {}
    for path in (data_file_path(prefix), index_file_path(prefix)):
        stat = os.stat(path)
        fingerprint[os.path.basename(path)] = [stat.st_size, stat.st_mtime_ns]
    return fingerprint


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def cache_directory(prefix: str, cache_dir: str | Path | None) -> Path:
    data_dir = Path(prefix).resolve().parent
    if os.access(data_dir, os.W_OK):
        return data_dir
    return Path(cache_dir) if cache_dir else default_cache_root() / "index_cache"


def _write_npy(path: Path, array: np.ndarray) -> None:
    with path.open("wb") as stream:
        np.save(stream, array, allow_pickle=False)


def load_or_build(
    prefix: str,
    name: str,
    settings: dict,
    build: Callable[[], dict[str, np.ndarray]],
    cache_dir: str | Path | None = None,
) -> tuple[dict[str, np.ndarray], bool]:
    """The arrays `build()` returns, from the cache when its settings and data fingerprint match.

    Returns (arrays, built) where built says whether `build()` ran."""
    directory = cache_directory(prefix, cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    key = settings_hash({"prefix": str(Path(prefix).resolve()), **settings})
    stem = f"{Path(prefix).name}_{name}_indexmap_{key}"
    meta_path = directory / f"{stem}_meta.json"
    meta = {"settings": settings, "data": data_fingerprint(prefix)}
    if meta_path.is_file():
        try:
            cached_meta = json.loads(meta_path.read_text())
            if cached_meta["settings"] == meta["settings"] and cached_meta["data"] == meta["data"]:
                arrays = {array: np.load(directory / f"{stem}_{array}.npy", mmap_mode="r")
                          for array in cached_meta["arrays"]}
                return arrays, False
        except (OSError, ValueError, KeyError):
            pass  # unreadable or incomplete cache: rebuild it below
    with slow_stage(f"building the {name} index of {prefix} (kept for later runs)"):
        arrays = build()
    for array_name, array in arrays.items():
        write_atomically(directory / f"{stem}_{array_name}.npy", lambda tmp, a=array: _write_npy(tmp, a))
    meta["arrays"] = sorted(arrays)
    write_atomically(meta_path, lambda tmp: tmp.write_text(json.dumps(meta, sort_keys=True)))
    return arrays, True
