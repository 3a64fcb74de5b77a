"""The generated documentation is what its command writes today (the command is at each file's top)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_configuration_md_is_what_its_command_writes():
    committed = (REPO / "docs" / "configuration.md").read_text()
    command = "python tools/docs/configuration.py > docs/configuration.md"
    assert command in committed.splitlines()[2], "docs/configuration.md should name the command that writes it"
    written = subprocess.run([sys.executable, "tools/docs/configuration.py"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
    assert written == committed, f"docs/configuration.md is out of date with the schema: run `{command}`"
