"""Checkpoint save and load: the entry points the training loop calls (this file only re-exports them).

    plan = plan_load(args, dp_size)          # load.py, before deepspeed.initialize: inspect files, fail fast
    check_save_dir(args)                     # save.py, before the first step: `save` writable, room, locked
    engine = deepspeed.initialize(...)
    outcome = load_checkpoint(engine, plan)  # load.py: the plan is the whole contract
    ...
    save_checkpoint(args, engine, iteration, consumed_train_samples, ..., lineage=outcome.lineage)  # save.py
    check_save_in_flight()                   # async_save.py, every step; saves_waited_for() around the loop
"""

from megatron.checkpointing.async_save import check_save_in_flight, saves_waited_for, wait_for_save_in_flight
from megatron.checkpointing.client_state import ClientState
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.lineage import Lineage
from megatron.checkpointing.load import LoadOutcome, load_checkpoint, load_weights_only, plan_load
from megatron.checkpointing.plan import LoadMode, LoadPlan
from megatron.checkpointing.save import check_save_dir, save_checkpoint

__all__ = [
    "CheckpointError", "ClientState", "Lineage", "LoadMode", "LoadOutcome", "LoadPlan", "check_save_dir",
    "check_save_in_flight", "load_checkpoint", "load_weights_only", "plan_load", "save_checkpoint",
    "saves_waited_for", "wait_for_save_in_flight",
]
