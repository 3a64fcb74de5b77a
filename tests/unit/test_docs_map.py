"""docs/architecture.md's map of the rooms names every package and root module of megatron/, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _map_rows() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "`" in line]


def test_the_map_names_every_package_and_root_module_once():
    named = []
    for row in _map_rows():
        where = row.split("|")[2]
        names = re.findall(r"`([^`]+)`", where)
        folder = "megatron/"
        for name in names:
            if name.startswith("megatron/"):
                folder = name.rsplit("/", 1)[0] + "/" if name.endswith(".py") else folder
                named.append(name.rstrip("/"))
            elif name.endswith(".py") and folder == "megatron/" and not (REPO / name).exists():
                named.append(f"megatron/{name}")
    root = REPO / "megatron"
    present = sorted([f"megatron/{p.name}" for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
                     + [f"megatron/{p.name}" for p in root.glob("*.py") if p.name != "__init__.py"])
    assert sorted(named) == present
