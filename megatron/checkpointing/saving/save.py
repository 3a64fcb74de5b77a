"""Save: the one place a checkpoint is written.

    check_save_dir(args)                     # before the first step: `save` writable, room for a tag, locked
    ...
    save_checkpoint(args, engine, iteration, consumed_train_samples, ..., lineage=outcome.lineage)

A tag is written into `<tag>.partial`, then committed (commit.commit_tag: the manifest, the rename, `latest`
last, then the run's older tags are pruned, lineage.py). With `async_save` the same commit runs in a
background thread once the state is copied to host memory (async_save.py); a blocking save runs it at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.ondisk.client_state import ClientState
from megatron.checkpointing.ondisk.rng import collect_rng_states
from megatron.checkpointing.planning.lineage import Lineage
from megatron.checkpointing.saving import async_save, commit, save_lock
from megatron.checkpointing.saving.neox_config import write_neox_config
from megatron.ranks import global_rank
from megatron.runtime.collective import all_gather, decided_by_rank_zero


def _gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's generator states, indexed by global rank (dropout differs per rank)."""
    return all_gather(collect_rng_states())


def _logger():
    from megatron.logging import get_logger

    return get_logger()


def save_checkpoint(
    args, engine, iteration: int, consumed_train_samples: int, lr_schedule_start: int = 0,
    lr_schedule: dict | None = None, consumed_valid_samples: int = 0, lineage: Lineage | None = None,
    reference_model: dict | None = None, lora_base: dict | None = None, rollouts: dict | None = None,
    reward_model: dict | None = None,
) -> Path:
    """Save tag global_step<iteration> under `args.save`; all ranks call it (DeepSpeed's save is collective).

    The run's YAML files and all its settings as one GPT-NeoX config (neox_config.py) go into
    `<tag>/configs/` first, then the engine's files; `latest` names the tag once every file is written, then old
    tags are pruned per `keep_last_n_checkpoints`: only tags of `lineage` (the run's own, which this save joins;
    without one, only this tag). `reference_model` is the identity of a DPO/KTO run's reference (reference.py).
    With `lora_base`, the identity of a LoRA run's frozen base (LoadOutcome.lora_base), the tag is adapter-only:
    it holds the parameters that train, their optimizer states and the run's state, and names that base.
    `rollouts` is this rank's REINFORCE rollout state (every rank passes one or none); the tag holds them all.
    `reward_model` is the identity of the reward model scoring a REINFORCE run's completions (reward_model_source.py).

    With `async_save`, inside `saves_waited_for` (the training loop), it returns once the state is copied to
    host memory, and the files, the manifest, `latest` and the pruning follow in the background
    (async_save.py); it waits first for the save in flight. Elsewhere nothing would wait for a background
    save, so it writes the tag before it returns.
    """
    from megatron.checkpointing.ondisk import forward_validation
    from megatron.checkpointing.saving.engine_save import save_engine_checkpoint
    from megatron.checkpointing.saving.snapshot_engine import SnapshotCheckpointEngine

    if not args.save:
        raise CheckpointError("save_checkpoint was called but `save` is not set; set `save: <directory>`.")
    async_save.wait_for_save_in_flight()
    save_dir = Path(args.save).expanduser()
    tag = layout.tag_for_iteration(iteration)
    client_state = ClientState(
        iteration=int(iteration),
        consumed_train_samples=int(consumed_train_samples),
        consumed_valid_samples=int(consumed_valid_samples),
        settings=args.to_dict(),
        rng_states=_gather_rng_states(),
        lr_schedule_start=int(lr_schedule_start),
        lr_schedule=lr_schedule,
        reference_model=reference_model,
        lora_base=lora_base,
        rollouts=all_gather(rollouts) if rollouts is not None else None,
        reward_model=reward_model,
        forward_validation=(forward_validation.capture(engine, args)
                            if args.checkpoint_validation_with_forward_pass else None),
    )

    in_background = args.async_save and async_save.awaited()
    snapshot = SnapshotCheckpointEngine(engine.checkpoint_engine) if in_background else None
    lineage = lineage if lineage is not None else Lineage()
    lineage.saved.add(tag)

    def committed() -> None:
        _prune(args.keep_last_n_checkpoints, save_dir, tag, lineage)

    def write_files(partial: Path):
        if global_rank() == 0:
            layout.copy_configs(args.config_files, partial)
            write_neox_config(args.to_dict(), partial / layout.CONFIGS_DIR / layout.NEOX_CONFIG_FILE)
        return save_engine_checkpoint(engine, save_dir, partial.name, client_state.to_dict(),
                                      optimizer_states=not args.no_save_optim, snapshot=snapshot,
                                      frozen_weights=lora_base is None)

    try:
        if snapshot is None:
            return commit.write_tag(save_dir, tag, iteration, write_files, committed)
        commit.stop_if_any_rank_failed(save_dir, tag, write_files(commit.start_writing(save_dir, tag)))
    except Exception as err:
        failure = commit.save_failed(save_dir, tag, err)
        commit.discard_partial(save_dir, tag)
        if failure is None:
            raise
        raise failure from err
    async_save.start(save_dir, tag, iteration, snapshot, committed)
    return save_dir / tag


def _prune(keep_last_n_checkpoints: int | None, save_dir: Path, tag: str, lineage: Lineage) -> None:
    message = f"saved checkpoint {save_dir / tag}"
    if keep_last_n_checkpoints is not None:
        ours = lineage.tags(save_dir)
        deleted = layout.prune_checkpoints(save_dir, keep_last_n_checkpoints, ours,
                                           protected=[lineage.loaded_tag] if lineage.loaded_tag else [])
        if deleted:
            message += f" (deleted older tags {', '.join(deleted)}: keep_last_n_checkpoints is {keep_last_n_checkpoints})"
        others = [name for name in layout.list_tags(save_dir) if name not in ours]
        if others:
            message += (f"; kept {', '.join(others)}: not saved by this run nor before the tag it loaded "
                        f"(left from before a rollback?), so keep_last_n_checkpoints does not delete them")
    _logger().info(message)


def check_save_dir(args) -> None:
    """Before the first step, on every rank (collective): `save` can be written, has room for one more tag, and no
    other run saves there. Global rank 0 takes the directory's lock for the rest of its process (save_lock.py);
    when it cannot, every rank raises the same one-line error."""
    if not args.save:
        return
    problem = None
    if global_rank() == 0:
        try:
            commit.check_room_and_access(args.save, 0)
            save_lock.acquire(args.save, list(args.config_files or ()), notice=_logger().info)
        except CheckpointError as err:
            problem = str(err)
    decided = decided_by_rank_zero(problem)
    if decided:
        raise CheckpointError(decided)
    if global_rank() != 0:
        commit.check_room_and_access(args.save, global_rank())
