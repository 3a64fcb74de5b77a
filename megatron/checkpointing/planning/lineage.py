"""Which tags of the save directory a run may prune: the ones it saved, and the tag it loaded from that
directory with the tags before it (never a tag another run left there, e.g. above a rollback).

The load starts a run's lineage (in its LoadOutcome), every save adds to it, and pruning reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron.checkpointing.ondisk import layout


@dataclass
class Lineage:
    loaded_tag: str | None = None
    loaded_iteration: int | None = None  # the loaded tag and those up to this iteration are the run's history
    saved: set[str] = field(default_factory=set)

    def tags(self, save_dir: Path) -> set[str]:
        ancestors = {tag for tag, iteration in layout.list_tags(save_dir).items()
                     if self.loaded_iteration is not None and iteration <= self.loaded_iteration}
        return ancestors | self.saved
