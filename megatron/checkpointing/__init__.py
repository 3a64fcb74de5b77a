"""Checkpoint save and load: the entry points the training loop calls.

    plan = plan_load(args, dp_size)          # before deepspeed.initialize: inspect files, fail fast
    check_save_dir(args)                     # before the first step: `save` writable, room for a tag, locked
    engine = deepspeed.initialize(...)
    outcome = load_checkpoint(args, engine, plan)
    ...
    save_checkpoint(args, engine, iteration, consumed_train_samples, lr_schedule_start, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron.checkpointing import commit, layout, manifest, preflight, save_lock
from megatron.checkpointing.client_state import ClientState
from megatron.checkpointing.data_position import DataPosition, data_position
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.inventory import inventory_checkpoint
from megatron.checkpointing.neox_config import write_neox_config
from megatron.checkpointing.plan import LoadMode, LoadPlan, build_load_plan
from megatron.checkpointing.rng import collect_rng_states, restore_rng_states
from megatron.checkpointing.weights_source import WeightsSource
from megatron.collective import all_gather, barrier
from megatron.ranks import global_rank, rank_and_world, tensor_parallel_rank, tensor_parallel_size

if TYPE_CHECKING:  # module_load imports DeepSpeed's ZeRO internals; loaded only when a load needs it
    from megatron.checkpointing.module_load import ModuleLoadReport

__all__ = [
    "CheckpointError", "ClientState", "LoadMode", "LoadOutcome", "LoadPlan", "check_save_dir", "load_checkpoint",
    "plan_load", "save_checkpoint",
]

@dataclass(frozen=True)
class LoadOutcome:
    iteration: int
    consumed_train_samples: int
    loaded_optimizer: bool
    restored_rng: bool
    tag: str | None
    client_state: ClientState = field(repr=False)
    consumed_valid_samples: int = 0  # where the next evaluation's validation batches start
    # what a module-only load copied and skipped (None when DeepSpeed resumed the whole engine)
    module_report: ModuleLoadReport | None = field(default=None, repr=False)


@dataclass
class _Lineage:
    """The tags of one save directory that this process's run may prune: the ones it saved, and the
    tag it loaded from that directory with the tags before it."""

    loaded_tag: str | None = None
    loaded_iteration: int | None = None
    saved: set[str] = field(default_factory=set)

    def tags(self, save_dir: Path) -> set[str]:
        ancestors = {tag for tag, iteration in layout.list_tags(save_dir).items()
                     if self.loaded_iteration is not None and iteration <= self.loaded_iteration}
        return ancestors | self.saved


_lineages: dict[Path, _Lineage] = {}


def _lineage(directory: str | Path) -> _Lineage:
    return _lineages.setdefault(Path(directory).expanduser().resolve(), _Lineage())


def _gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's generator states, indexed by global rank (dropout differs per rank)."""
    return all_gather(collect_rng_states())


def _logger():
    from megatron.logging import get_logger

    return get_logger()


def save_checkpoint(
    args, engine, iteration: int, consumed_train_samples: int, lr_schedule_start: int = 0,
    lr_schedule: dict | None = None, consumed_valid_samples: int = 0,
) -> Path:
    """Save tag global_step<iteration> under `args.save`; all ranks call it (DeepSpeed's save is collective).

    The run's YAML files and all its settings as one GPT-NeoX config (neox_config.py) go into
    `<tag>/configs/` first, then the engine's files; `latest` names the tag once every file is written, then old
    tags are pruned per `keep_last_n_checkpoints`.
    """
    from megatron.checkpointing import forward_validation
    from megatron.checkpointing.engine_save import save_engine_checkpoint

    if not args.save:
        raise CheckpointError("save_checkpoint was called but `save` is not set; set `save: <directory>`.")
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
        forward_validation=(forward_validation.capture(engine, args)
                            if args.checkpoint_validation_with_forward_pass else None),
    )

    partial = layout.partial_tag(tag)
    try:
        if global_rank() == 0:
            commit.start_tag(save_dir, tag)
            layout.copy_configs(args.config_files, save_dir / partial)
            write_neox_config(args.to_dict(), save_dir / partial / layout.CONFIGS_DIR / layout.NEOX_CONFIG_FILE)
        barrier()
        commit.stop_if_any_rank_failed(
            save_dir, tag, save_engine_checkpoint(engine, save_dir, partial, client_state.to_dict()))
        tag_dir = commit.seal_tag(save_dir, tag, iteration)
    except Exception as err:
        failure = commit.save_failed(save_dir, tag, err)
        commit.discard_partial(save_dir, tag)
        if failure is None:
            raise
        raise failure from err
    if global_rank() == 0:
        _prune(args, save_dir, tag, iteration)
    barrier()
    return tag_dir


def _prune(args, save_dir: Path, tag: str, iteration: int) -> None:
    lineage = _lineage(save_dir)
    lineage.saved.add(tag)
    message = f"saved checkpoint {save_dir / tag}"
    if args.keep_last_n_checkpoints is not None:
        ours = lineage.tags(save_dir)
        deleted = layout.prune_checkpoints(save_dir, args.keep_last_n_checkpoints, ours,
                                           protected=[lineage.loaded_tag] if lineage.loaded_tag else [])
        if deleted:
            message += f" (deleted older tags {', '.join(deleted)}: keep_last_n_checkpoints is {args.keep_last_n_checkpoints})"
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
            commit.check_save_dir(args.save, 0)
            save_lock.acquire(args.save, list(args.config_files or ()), notice=_logger().info)
        except CheckpointError as err:
            problem = str(err)
    first = all_gather(problem)[0]
    if first:
        raise CheckpointError(first)
    if global_rank() != 0:
        commit.check_save_dir(args.save, global_rank())


def plan_load(args, data_parallel_size: int, hf_source: WeightsSource | None = None) -> LoadPlan | None:
    """Inspect `args.load` and decide what to load; call before deepspeed.initialize so bad loads fail fast.

    None when `load` is unset. Raises CheckpointError when the plan cannot be carried out. With
    `hf_source` (megatron.hf.HF_FOLDER) `load` may name a Hugging Face model folder.
    """
    if not args.load:
        return None
    plan = build_load_plan(args, inventory_checkpoint(args.load, hf_source), data_parallel_size)
    _logger().info(plan.describe())
    return plan


def _module_weights(plan: LoadPlan, args):
    if plan.hf_source is not None:
        return _this_ranks_part([plan.hf_source.read_weights(plan.load_dir, args.architecture())], args)
    from megatron.checkpointing.module_weights import read_module_weights

    rank, size = tensor_parallel_rank(), tensor_parallel_size()
    saved = preflight.saved_tensor_parallel_size(plan.tag_inventory)
    if saved == size:
        return read_module_weights(plan.tag_dir, rank)
    return _this_ranks_part([read_module_weights(plan.tag_dir, mp) for mp in range(saved)], args)


def _this_ranks_part(parts: list[dict], args) -> dict:
    """This tensor-parallel rank's slices of weights saved by ``len(parts)`` ranks (memory-mapped parts are
    read only where the slices lie)."""
    from megatron.model.partitioning import repartition_state_dict

    rank, size = tensor_parallel_rank(), tensor_parallel_size()
    if len(parts) == size:
        return parts[rank]
    return repartition_state_dict(parts, args.architecture(), rank, size)


def _saved_progress(plan: LoadPlan, client_state: ClientState, args) -> tuple[int, DataPosition]:
    """Iteration and data position to continue from; counts the checkpoint lacks are derived as the plan said."""
    if not plan.iteration_from_checkpoint:
        return 0, DataPosition()
    iteration = int(plan.saved_iteration)
    return iteration, data_position(client_state, iteration, args)


def _check_names_for_resume(plan: LoadPlan, engine, args) -> None:
    """DeepSpeed restores the module of a full resume under the names stored; older GPT-NeoX names and a
    non-strict load are checked here first, as the module-only path checks them."""
    from megatron.checkpointing.module_load import check_random_layers, compare_module_keys
    from megatron.checkpointing.module_weights import legacy_names_in_model_states_file, read_module_weights

    legacy = legacy_names_in_model_states_file(plan.tag_dir)
    if legacy:
        raise CheckpointError(
            f"{plan.tag_dir} stores GPT-NeoX's older parameter names ({', '.join(legacy[:3])}, ...); a full resume "
            "restores the module under the stored names, which this model does not have. Set `no_load_optim: true` "
            "(keeps iteration and data position) or `finetune: true` to load these weights with a fresh optimizer."
        )
    if not args.load_module_strict:
        targets = engine.module.state_dict(keep_vars=True)
        report = compare_module_keys(targets, read_module_weights(plan.tag_dir, tensor_parallel_rank()))
        check_random_layers(report, targets, args.load_module_allow_random or ())
        if not report.complete:
            _logger().info(report.describe())


def _verify_files(plan: LoadPlan) -> None:
    """Check the files DeepSpeed's load reads against the tag's manifest, each file on one rank, before any is read."""
    records = manifest.read_manifest(plan.tag_dir)
    if records is None:
        return
    rank, world = rank_and_world()
    mine = [manifest.check_file(path, records, plan.tag_dir) for path in plan.files[rank::world]]
    problems = [problem for part in all_gather(mine) for problem in part if problem]
    if problems:
        raise CheckpointError(problems[0])


def load_checkpoint(args, engine, plan: LoadPlan) -> LoadOutcome | None:
    """Carry out `plan` on `engine`; None when the plan has nothing to load (auto-resume first run)."""
    from megatron.checkpointing import forward_validation

    if plan.nothing_to_load:
        return None
    if plan.tag_dir is not None:
        if plan.load_optimizer:  # the module-only path checks the files it reads itself
            _verify_files(plan)
        if layout.same_directory(plan.load_dir, args.save):
            # a fine-tune counts from 0 again: the tags before the one it loaded are not its history
            ancestors_up_to = plan.saved_iteration if plan.iteration_from_checkpoint else None
            _lineages[Path(plan.load_dir).resolve()] = _Lineage(plan.tag, ancestors_up_to)
    module_report = None
    if plan.load_optimizer:
        from megatron.checkpointing.safe_checkpoint_engine import use_weights_only_checkpoint_engine
        from megatron.checkpointing.safe_unpickle import every_torch_load_weights_only

        _check_names_for_resume(plan, engine, args)
        use_weights_only_checkpoint_engine(engine)
        with every_torch_load_weights_only(plan.tag_dir):
            load_path, stored = engine.load_checkpoint(
                str(plan.load_dir),
                tag=plan.tag,
                load_module_strict=args.load_module_strict,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,  # the LR is a function of the iteration
            )
        if load_path is None:
            raise CheckpointError(
                f"DeepSpeed did not load {plan.tag_dir} (engine.load_checkpoint returned no path); "
                f"the files it reads are {[p.name for p in plan.files]}. Check they are readable."
            )
        client_state = ClientState.from_dict(stored or {})
        from megatron.optimizers import replay_cpu_adam_step_count

        replay_cpu_adam_step_count(engine)
    else:
        from megatron.checkpointing.module_load import load_module_only

        module_report = load_module_only(engine, _module_weights(plan, args), strict=args.load_module_strict,
                                         allow_random=args.load_module_allow_random or ())
        if not module_report.complete:
            _logger().info(module_report.describe())
        client_state = plan.client_state
    if args.checkpoint_validation_with_forward_pass and plan.source_format != "hf":
        forward_validation.check(engine, args, client_state.forward_validation, source=str(plan.tag_dir))
    if plan.restore_rng:
        restore_rng_states(client_state.rng_states[global_rank()])
    iteration, position = _saved_progress(plan, client_state, args)
    _logger().info(f"loaded {plan.tag_dir or plan.load_dir} ({plan.mode.value}): starting at iteration {iteration}, "
                   f"{position.consumed_train_samples} samples consumed")
    return LoadOutcome(iteration=iteration, consumed_train_samples=position.consumed_train_samples,
                       consumed_valid_samples=position.consumed_valid_samples, loaded_optimizer=plan.load_optimizer,
                       restored_rng=plan.restore_rng, tag=plan.tag, client_state=client_state,
                       module_report=module_report)
