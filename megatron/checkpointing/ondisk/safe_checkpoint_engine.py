"""DeepSpeed's torch checkpoint engine, reading weights-only: what a full resume's load_checkpoint reads through.

DeepSpeed 0.16-0.19 read every file of ``engine.load_checkpoint`` (model states, ZeRO optimizer
shards, the non-ZeRO optimizer) through ``engine.checkpoint_engine.load``, whose TorchCheckpointEngine
unpickles with ``weights_only=False``. This subclass unpickles through safe_unpickle instead and saves
exactly as DeepSpeed's own. Its universal-checkpoint readers call torch.load themselves; the load
runs inside safe_unpickle.every_torch_load_weights_only for them.

The files are checked against the manifest before DeepSpeed reads any (checkpointing.load._verify_files),
not here again.
"""

from __future__ import annotations

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk.safe_unpickle import load_weights_only


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    def load(self, path: str, map_location=None):
        return load_weights_only(path, map_location=map_location, mmap=False)


def use_weights_only_checkpoint_engine(engine) -> None:
    """Give `engine` a WeightsOnlyCheckpointEngine in place of the TorchCheckpointEngine DeepSpeed built."""
    current = engine.checkpoint_engine
    if isinstance(current, WeightsOnlyCheckpointEngine):
        return
    if type(current) is not TorchCheckpointEngine:
        raise CheckpointError(
            f"the DeepSpeed checkpoint engine {type(current).__name__} (chosen by the DeepSpeed config's checkpoint "
            "writer or datastates settings) reads checkpoints with its own unpickler, which this trainer cannot "
            "make weights-only; remove those settings to resume through the torch checkpoint engine."
        )
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)
