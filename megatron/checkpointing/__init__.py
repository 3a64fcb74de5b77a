"""Checkpoint save and load: the front door. Training, the entry points, the tools and the benches import
from here only; the stages below are this package's inside.

    plan = plan_load(args, dp_size)          # before deepspeed.initialize: inspect files, decide, fail fast
    check_save_dir(args)                     # before the first step: `save` writable, room, locked
    engine = deepspeed.initialize(...)
    outcome = load_checkpoint(engine, plan)  # the plan is the whole contract
    ...
    save_checkpoint(args, engine, iteration, consumed_train_samples, ..., lineage=outcome.lineage)
    check_save_in_flight()                   # every step; saves_waited_for() around the loop

Stages, each importing only those above it (tests/unit/test_import_graph.py pins the order):

| stage      | owns                                                                      | decides                    |
| formats    | formats from elsewhere: GPT-NeoX's older names, the HF folder interface    |                            |
| ondisk     | what is on disk and whether it can be trusted: file names, manifests,       | which tag; what was saved  |
|            | weights-only unpickling, the inventory of a directory and its SavedLayout  | and at what layout         |
| planning   | the load plan: what is loaded and what starts fresh, shape changes, checks | did the shape change; what |
|            | against the run's settings, data position, the DPO/KTO reference, lineage  | is loaded                  |
| loading    | carrying a plan into a DeepSpeed engine: module-only, masters, reshard      |                            |
| saving     | writing and committing tags (one commit path for blocking and async saves) | when a save is complete    |

How ranks agree is megatron/runtime/collective.py's, for every stage.
"""

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.formats.legacy_names import is_legacy_buffer_key, translate_legacy_key
from megatron.checkpointing.loading.load import LoadOutcome, load_checkpoint, load_weights_only
from megatron.checkpointing.ondisk.client_state import ClientState
from megatron.checkpointing.ondisk.identity import (
    LORA_BASE_FILE,
    LoraBase,
    ReferenceIdentity,
    RewardModelIdentity,
    files_checksum,
    write_lora_base_file,
)
from megatron.checkpointing.ondisk.inventory import CheckpointInventory, TagInventory, inventory_checkpoint
from megatron.checkpointing.ondisk.layout import (
    LATEST_FILE,
    layer_file_name,
    model_states_name,
    run_entries,
    tag_for_iteration,
)
from megatron.checkpointing.ondisk.manifest import verify_files
from megatron.checkpointing.ondisk.module_weights import (
    layer_states,
    read_full_module_weights,
    read_module_weights,
)
from megatron.checkpointing.ondisk.safe_unpickle import load_weights_only as load_file_weights_only
from megatron.checkpointing.ondisk.safe_unpickle import plain_values
from megatron.checkpointing.ondisk.verified_files import checks_beside_use, forget_checked_files
from megatron.checkpointing.planning.data_position import samples_per_evaluation
from megatron.checkpointing.planning.lineage import Lineage
from megatron.checkpointing.planning.load_settings import LoadSettings
from megatron.checkpointing.planning.plan import (
    LoadMode,
    LoadPlan,
    build_load_plan,
    lora_base_plan,
    plan_for,
    plan_load,
    plan_load_for,
)
from megatron.checkpointing.planning.reference import (
    TRAIN_IMPLS_WITH_REFERENCE,
    needs_reference,
    plan_reference,
)
from megatron.checkpointing.planning.reference import describe as describe_reference
from megatron.checkpointing.planning.reward_model_source import describe as describe_reward_model
from megatron.checkpointing.planning.reward_model_source import plan_reward_model
from megatron.checkpointing.saving.async_save import (
    check_save_in_flight,
    save_in_flight,
    saves_waited_for,
    wait_for_save_in_flight,
)
from megatron.checkpointing.saving.commit import newest_tag_size, write_tag
from megatron.checkpointing.saving.save import check_save_dir, save_checkpoint

# These import DeepSpeed's engine internals: resolved on first use, so importing this package does not start
# DeepSpeed (the settings, the tools' --help and the launcher import it).
_IMPORTED_ON_USE = {
    "load_module_only": "megatron.checkpointing.loading.module_load",
    "save_engine_checkpoint": "megatron.checkpointing.saving.engine_save",
    "verify_master_weights": "megatron.checkpointing.loading.master_weights",
}


def __getattr__(name: str):
    if name not in _IMPORTED_ON_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_IMPORTED_ON_USE[name]), name)


__all__ = [
    "LATEST_FILE", "LORA_BASE_FILE", "TRAIN_IMPLS_WITH_REFERENCE", "CheckpointError", "CheckpointInventory",
    "ClientState", "Lineage", "LoadMode", "LoadOutcome", "LoadPlan", "LoadSettings", "LoraBase",
    "ReferenceIdentity", "RewardModelIdentity", "TagInventory", "build_load_plan", "check_save_dir", "check_save_in_flight",
    "checks_beside_use", "describe_reference", "describe_reward_model", "files_checksum", "forget_checked_files", "inventory_checkpoint",
    "is_legacy_buffer_key", "layer_file_name", "layer_states", "load_checkpoint", "load_file_weights_only",
    "load_module_only", "load_weights_only", "lora_base_plan", "model_states_name", "needs_reference", "plain_values", "plan_for",
    "plan_load", "plan_load_for", "plan_reference", "plan_reward_model", "newest_tag_size", "read_full_module_weights", "read_module_weights", "run_entries",
    "samples_per_evaluation", "save_checkpoint",
    "save_engine_checkpoint", "save_in_flight", "saves_waited_for", "tag_for_iteration", "translate_legacy_key",
    "verify_files", "verify_master_weights", "wait_for_save_in_flight", "write_lora_base_file", "write_tag",
]
