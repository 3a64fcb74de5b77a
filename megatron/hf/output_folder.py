"""The folder a converter writes into: what is there is kept unless the user asks to replace it.

A folder that already holds a model or a run (a `latest`, tags, weights, an HF config or tokenizer)
is refused unless `overwrite` is given: converting into a run's save folder would point its
`latest` at the converted weights, and a resume would load them without a word. The conversion is
written into a new folder beside the output and moved in only once it is complete, so a conversion
that fails leaves the output folder as it was. No output is, holds or lies in a file or folder its own
command reads, with `overwrite` or without (check_output_apart, which every tool's output passes).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron.checkpointing import LATEST_FILE, LORA_BASE_FILE, run_entries
from megatron.errors import ExpectedError
from megatron.fsio import fsync_path
from megatron.hf.errors import HFConversionError
from megatron.hf.io import (
    ADAPTER_CONFIG_NAME,
    BIN_INDEX_NAME,
    BIN_NAME,
    CONFIG_NAME,
    OTHER_MODEL_FOLDER_NAMES,
    SAFETENSORS_INDEX_NAME,
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_NAME,
)

_MODEL_NAMES = {
    CONFIG_NAME, TOKENIZER_NAME, TOKENIZER_CONFIG_NAME, SAFETENSORS_INDEX_NAME, BIN_INDEX_NAME, BIN_NAME,
    *OTHER_MODEL_FOLDER_NAMES, ADAPTER_CONFIG_NAME, LORA_BASE_FILE,
}
_WEIGHT_SUFFIXES = (".pt", ".safetensors")  # checkpoint files, HF weights and their shards
_BIN_SHARD_STEM = Path(BIN_NAME).stem  # pytorch_model-00001-of-00002.bin


def model_or_run_entries(folder: Path) -> list[str]:
    """The names in `folder` that belong to a model or a run: `latest` and the tag it names, tags (also
    partial ones), the save lock, weight files, an HF folder's config and tokenizer."""
    if not folder.is_dir():
        return []
    found = set(run_entries(folder))
    for entry in folder.iterdir():
        name = entry.name
        if (name in _MODEL_NAMES or name.endswith(_WEIGHT_SUFFIXES)
                or (name.startswith(_BIN_SHARD_STEM) and name.endswith(".bin"))):
            found.add(name)
    return sorted(found)


def check_output_apart(output: Path, inputs: Iterable[str | Path | None], flag: str,
                       error: type[ExpectedError] = HFConversionError) -> None:
    """The one guard of every tool's output: refuse an output file or folder that is, holds or lies in a file or
    folder the same command reads (`inputs`; None where an input is not given), `--overwrite` or not. Replacing
    it would destroy the input while it is read, or leave the command's own source unusable afterwards."""
    output_path = Path(output).expanduser().resolve()
    for source in filter(None, inputs):
        source_path = Path(source).expanduser().resolve()
        if output_path == source_path or output_path in source_path.parents or source_path in output_path.parents:
            raise error(f"{flag} {output} is, holds or lies in the input {source}, which this command reads; write the output "
                        "to a file or folder of its own")


def check_output_folder(out_dir: Path, sources: Iterable[str | Path | None], overwrite: bool) -> None:
    """Refuse an output folder that is a file, that overlaps one of `sources` (the inputs the conversion reads;
    replacing what is there could remove them), or that holds a model or a run (unless `overwrite`)."""
    out_dir = Path(out_dir)
    in_the_way = next((p for p in (out_dir, *out_dir.parents) if p.exists() and not p.is_dir()), None)
    if in_the_way is not None:
        raise HFConversionError(f"--output {out_dir}: {in_the_way} is a file, not a folder; name a folder to write "
                                "the conversion into")
    check_output_apart(out_dir, sources, "--output")
    found = model_or_run_entries(out_dir)
    if found and not overwrite:
        shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        raise HFConversionError(
            f"--output {out_dir} already holds a model or a run ({shown}); choose a new folder, or pass "
            "--overwrite to replace them (other files there are kept)")


@contextmanager
def staged_output(out_dir: Path) -> Iterator[Path]:
    """A new folder beside `out_dir` to write the whole conversion into. When the block completes, what
    `out_dir` holds of a model or a run is removed (`latest` first) and the new entries take their places
    (`latest` last); when it fails, `out_dir` is as it was and the new folder is removed."""
    out_dir = Path(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = _new_folder_beside(out_dir)
    except OSError as err:
        raise HFConversionError(f"--output {out_dir}: cannot write into {out_dir.parent} ({err.strerror}); choose a "
                                "folder you can write") from None
    try:
        yield staging
        if out_dir.is_dir():
            _move_entries_into(staging, out_dir)
        else:
            os.rename(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    fsync_path(out_dir.parent)


def _new_folder_beside(path: Path) -> Path:
    """An empty folder next to `path` with the permissions any new folder gets (mkdtemp's are 0700)."""
    while True:
        folder = path.parent / f".{path.name}.{secrets.token_hex(4)}.converting"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def _latest_last(names: list[str]) -> list[str]:
    return sorted(names, key=lambda name: name == LATEST_FILE)


def _move_entries_into(staging: Path, out_dir: Path) -> None:
    for name in reversed(_latest_last(model_or_run_entries(out_dir))):
        old = out_dir / name
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    for name in _latest_last([entry.name for entry in staging.iterdir()]):
        os.replace(staging / name, out_dir / name)
    fsync_path(out_dir)
