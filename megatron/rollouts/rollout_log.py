"""`rollout_log: PATH`: every completion trained on, one JSON object a line (appended), from tensor-parallel rank 0
of each data-parallel rank: data-parallel rank 0 writes PATH, rank r > 0 PATH.rank<r>."""

from __future__ import annotations

import json
from pathlib import Path


class RolloutLog:
    def __init__(self, path: str, data_parallel_rank: int):
        self.path = Path(path if data_parallel_rank == 0 else f"{path}.rank{data_parallel_rank}")
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, records: list[dict]) -> None:
        with self.path.open("a", encoding="utf-8") as out:
            out.writelines(json.dumps(record) + "\n" for record in records)
