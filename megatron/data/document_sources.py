"""Raw documents from local files: jsonl (chosen fields of each line) or plain text (one document per file)."""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterator
from pathlib import Path

from megatron.data.errors import DataError


def expand_input_paths(spec: str) -> list[Path]:
    """Comma-separated files or globs -> the matching files, in the given order (each glob sorted)."""
    paths: list[Path] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        matches = sorted(glob.glob(part, recursive=True)) if glob.has_magic(part) else [part]
        if not matches:
            raise DataError(f"input glob {part!r} matches no file")
        for match in matches:
            path = Path(match)
            if not path.is_file():
                raise DataError(f"input {match!r} is not a file")
            paths.append(path)
    if not paths:
        raise DataError(f"input {spec!r} names no file")
    return paths


def is_jsonl(path: Path) -> bool:
    return path.suffix in (".jsonl", ".json")


def iter_jsonl_records(paths: list[Path]) -> Iterator[tuple[Path, int, dict]]:
    """Yield (file, line number, parsed object) for every non-blank line of jsonl files."""
    for path in paths:
        with path.open("rb") as stream:  # decoded line by line, so that bad bytes are reported with their line
            for line_number, raw in enumerate(stream, start=1):
                line = _utf8_line(raw, path, line_number)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{line_number} is not valid JSON ({err})") from err
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{line_number} is a JSON {type(record).__name__}, not an object with fields")
                if _SURROGATE_ESCAPE.search(line):
                    _check_no_lone_surrogate(record, path, line_number)
                yield path, line_number, record


# JSON may spell a character outside the BMP as a pair of \ud800-\udfff escapes; one alone is no character
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _utf8_line(raw: bytes, path: Path, line_number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}:{line_number} is not UTF-8 text (byte {raw[err.start]:#04x} at byte {err.start + 1} "
                        "of the line); convert the file to UTF-8") from None


def _check_no_lone_surrogate(record: dict, path: Path, line_number: int) -> None:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        escape = f"\\u{ord(err.object[err.start]):04x}"
        raise DataError(f"{path}:{line_number} holds {escape}, half of a UTF-16 surrogate pair without its other half, "
                        "which is no character; fix or remove that escape") from None


def missing_key_error(path: Path, line_number: int, key: str, record: dict, flag: str = "--jsonl-keys") -> DataError:
    return DataError(f"{path}:{line_number} has no field {key!r}; choose the fields with {flag} "
                     f"(found {sorted(record)})")


def iter_documents(paths: list[Path], jsonl_keys: list[str]) -> Iterator[dict[str, str]]:
    """Yield {key: text} per document; a plain-text file is one document under every key."""
    for path in paths:
        if not is_jsonl(path):
            text = path.read_text(encoding="utf-8", errors="replace")
            yield {key: text for key in jsonl_keys}
            continue
        for _, line_number, record in iter_jsonl_records([path]):
            missing = [key for key in jsonl_keys if key not in record]
            if missing:
                raise missing_key_error(path, line_number, missing[0], record)
            yield {key: str(record[key]) for key in jsonl_keys}
