"""What a rank worker tells the test that started it: JSON records, one a line and a file per rank, in the
folder conftest.run_rank_worker names; the test reads them back as data instead of matching printed text."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPORT_DIR_ENV = "WORKER_REPORT_DIR"


def report(**fields: Any) -> None:
    """Record `fields` (JSON values) for the test, tagged with this process's global rank."""
    rank = int(os.environ.get("RANK", "0"))
    with open(Path(os.environ[REPORT_DIR_ENV]) / f"rank{rank}.jsonl", "a") as handle:
        handle.write(json.dumps({"rank": rank, **fields}) + "\n")


def read_reports(directory: Path) -> list[dict[str, Any]]:
    """Every record the ranks wrote into `directory`, by rank, each rank's in the order written."""
    return [json.loads(line) for path in sorted(Path(directory).glob("rank*.jsonl"))
            for line in path.read_text().splitlines()]


def reported(records: list[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """The records holding every one of `fields` with the value given."""
    return [record for record in records if all(record.get(key) == value for key, value in fields.items())]
