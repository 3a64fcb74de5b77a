"""Load: the one place a checkpoint is carried into an engine.

    plan = plan_load(args, dp_size)          # planning/plan.py, before deepspeed.initialize: fail fast
    engine = deepspeed.initialize(...)
    outcome = load_checkpoint(engine, plan)  # the plan is the whole contract: no settings are read here

A full resume goes through DeepSpeed's own engine.load_checkpoint (files checked against the manifest
first, unpickled weights-only); a fresh optimizer takes the module-only path (module_weights.py,
module_load.py, master_weights.py). The outcome says where training continues and starts the run's
pruning lineage (lineage.py).

An adapter-only tag (plan.base) loads its base's weights and its own as one module: on a full resume the
frozen base and the adapters go in through the module-only path first, then DeepSpeed restores the adapters
and their optimizer states from the tag (which holds nothing else of the module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.ondisk import layout
from megatron.checkpointing.ondisk.client_state import ClientState
from megatron.checkpointing.ondisk.identity import LoraBase
from megatron.checkpointing.ondisk.inventory import FORMAT_PIPELINE
from megatron.checkpointing.ondisk.rng import restore_rng_states
from megatron.checkpointing.ondisk.verified_files import checkpoint_file_problem, checks_beside_use
from megatron.checkpointing.planning.lineage import Lineage
from megatron.checkpointing.planning.plan import ADAPTERS, LM_HEAD, REWARD_HEAD, LoadPlan
from megatron.ranks import global_rank, rank_and_world, tensor_parallel_rank
from megatron.runtime.collective import reported_by_ranks

if TYPE_CHECKING:  # module_load imports DeepSpeed's ZeRO internals; loaded only when a load needs it
    from megatron.checkpointing.loading.module_load import ModuleLoadReport


@dataclass(frozen=True)
class LoadOutcome:
    iteration: int
    consumed_train_samples: int
    loaded_optimizer: bool
    restored_rng: bool
    tag: str | None
    client_state: ClientState = field(repr=False)
    consumed_valid_samples: int = 0  # where the next evaluation's validation batches start
    lr_schedule_start: int = 0  # the iteration the LR schedule counts from (plan.schedule_start)
    # the tags the run may prune; its saves add theirs (save.save_checkpoint)
    lineage: Lineage = field(default_factory=Lineage, repr=False, compare=False)
    # what a module-only load copied and skipped (None when DeepSpeed resumed the whole engine)
    module_report: ModuleLoadReport | None = field(default=None, repr=False)
    lora_base: LoraBase | None = None  # the frozen base a LoRA run's saves name (plan.lora_base)


def _logger():
    from megatron.logging import get_logger

    return get_logger()


def _is_stage(module) -> bool:
    """``module`` is a pipeline stage (DeepSpeed's PipelineModule, megatron/model/pipeline.py)."""
    from deepspeed.pipe import PipelineModule

    return isinstance(module, PipelineModule)


def _module_weights(plan: LoadPlan, engine):
    """This rank's weights, named as the engine's module names them: a pipeline stage takes its own layers."""
    from megatron.model.pipeline import stage_weights

    weights = _weights_read(plan, engine)
    return stage_weights(engine.module, weights) if _is_stage(engine.module) else weights


def _weights_read(plan: LoadPlan, engine) -> dict:
    """This rank's part of the weights `plan` loads; an adapter-only tag's over its base's."""
    from megatron.checkpointing.ondisk.module_weights import read_this_ranks_module_weights, this_ranks_part
    from megatron.model.weight_values import untrainable_weight

    if plan.hf_source is not None:
        weights = this_ranks_part([plan.hf_source.read_weights(plan.load_dir, plan.architecture)], plan.architecture)
    else:
        saved = plan.tag_inventory.saved_layout.tensor_parallel
        weights = read_this_ranks_module_weights(plan.tag_dir, saved, plan.architecture)
        problem = next(filter(None, (untrainable_weight(name, value) for name, value in weights.items())), None)
        if problem:
            raise CheckpointError(f"{plan.tag_dir}: {problem}")
    if plan.fresh_reward_head:
        weights = {name: value for name, value in weights.items() if not name.endswith(LM_HEAD)}
    if plan.base is None:
        return weights
    _check_adapters(plan, engine, weights)
    return {**_weights_read(plan.base, engine), **weights}


def _check_adapters(plan: LoadPlan, engine, weights: dict) -> None:
    """An adapter-only tag holds every parameter of the model that trains (a pipeline stage's: of its layers) and
    none that is frozen."""
    trains, frozen = set(), set()
    for name, param in _named_parameters(engine.module):
        (trains if param.requires_grad else frozen).add(name)
    missing = sorted(trains - set(weights))
    held_frozen = sorted(set(weights) & frozen)
    if not (missing or held_frozen):
        return
    tag = plan.tag_inventory
    if tag.format == FORMAT_PIPELINE:  # each layer's adapters are in its own layer file
        files = sorted({_layer_file(plan, name) for name in missing or held_frozen})
    else:
        files = list(tag.model_states_files.values())
    absent = [path for path in files if not path.exists()]
    problem = ("is missing" if absent else
               f"lacks {len(missing)} of the model's trainable parameters ({', '.join(missing[:3])}, ...): an "
               "incomplete save or other lora_* settings than the run that saved it" if missing else
               f"holds frozen base weights ({', '.join(held_frozen[:3])}, ...) beside the adapters")
    raise CheckpointError(f"{', '.join(map(str, absent or files))}, of an adapter-only tag over the base "
                          f"{plan.base.tag_dir or plan.base.load_dir}, {problem}. Load another tag with "
                          "`iteration: N`, or check the lora_* settings.")


def _named_parameters(module):
    """``module``'s parameters under GPTModel's names (a pipeline stage's under its layers' positions)."""
    from megatron.model.pipeline import gpt_model_name

    stage = _is_stage(module)
    return ((gpt_model_name(name) if stage else name, param) for name, param in module.named_parameters())


def _layer_file(plan: LoadPlan, name: str):
    """The layer file that holds GPTModel's parameter ``name`` in a pipeline tag: this tensor-parallel rank's,
    or model_00's where the tag is re-split for this run."""
    mp = 0 if plan.layout_change.tensor_parallel_changed else tensor_parallel_rank()
    return plan.tag_dir / layout.layer_file_name(int(name.split(".")[1]), mp)


def _check_stage_layer_files(plan: LoadPlan, engine) -> None:
    """DeepSpeed's pipe engine reads the layer file of every layer this stage holds, and fails on a missing one
    without naming it."""
    module = engine.module
    for index, layer in enumerate(module.forward_funcs):
        path = Path(module.ckpt_layer_path(str(plan.tag_dir), index))
        if hasattr(layer, "load_state_dict") and not path.exists():
            raise CheckpointError(f"{path} is missing from {plan.tag_dir}: DeepSpeed's pipe engine resumes each "
                                  "layer of a stage from its layer file. Restore it, or load another tag with "
                                  "`iteration: N`.")


def _check_names_for_resume(plan: LoadPlan, engine) -> None:
    """DeepSpeed restores the module of a full resume under the names stored; older GPT-NeoX names and a
    non-strict load are checked here first, as the module-only path checks them."""
    from megatron.checkpointing.loading.module_load import check_random_layers, compare_module_keys
    from megatron.checkpointing.ondisk.module_weights import (
        legacy_names_in_model_states_file,
        read_module_weights,
    )

    legacy = legacy_names_in_model_states_file(plan.tag_dir)
    if legacy:
        raise CheckpointError(
            f"{plan.tag_dir} stores GPT-NeoX's older parameter names ({', '.join(legacy[:3])}, ...); a full resume "
            "restores the module under the stored names, which this model does not have. Set `no_load_optim: true` "
            "(keeps iteration and data position) or `finetune: true` to load these weights with a fresh optimizer."
        )
    if not plan.strict:
        targets = engine.module.state_dict(keep_vars=True)
        report = compare_module_keys(targets, read_module_weights(plan.tag_dir, tensor_parallel_rank()))
        check_random_layers(report, targets, plan.allow_random)
        if not report.complete:
            _logger().info(report.describe())


def _verify_files(plan: LoadPlan) -> None:
    """Check the files DeepSpeed's load reads against the tag's manifest, each file on one rank, before any is read
    (a file the load plan read already, the model-states file, is not checked again)."""
    if plan.tag_inventory.manifest is None:
        return
    rank, world = rank_and_world()
    mine = [checkpoint_file_problem(path) for path in plan.files[rank::world]]
    problems = reported_by_ranks(next(filter(None, mine), None))
    if problems:
        raise CheckpointError(problems[0][1])


def _resume(engine, plan: LoadPlan) -> ClientState:
    """DeepSpeed's own load of the whole engine: module, optimizer states (fp32 master, moments), step counts."""
    from megatron.checkpointing.ondisk.safe_checkpoint_engine import use_weights_only_checkpoint_engine
    from megatron.checkpointing.ondisk.safe_unpickle import every_torch_load_weights_only
    from megatron.optim.optimizers import replay_cpu_adam_step_count

    _check_names_for_resume(plan, engine)
    if _is_stage(engine.module):
        _check_stage_layer_files(plan, engine)
    use_weights_only_checkpoint_engine(engine)
    with every_torch_load_weights_only(plan.tag_dir):
        load_path, stored = engine.load_checkpoint(
            str(plan.load_dir),
            tag=plan.tag,
            load_module_strict=plan.strict and plan.base is None,  # an adapter-only tag's: checked beforehand
            load_optimizer_states=True,
            load_lr_scheduler_states=False,  # the LR is a function of the iteration
        )
    if load_path is None:
        raise CheckpointError(
            f"DeepSpeed did not load {plan.tag_dir} (engine.load_checkpoint returned no path); "
            f"the files it reads are {[p.name for p in plan.files]}. Check they are readable."
        )
    replay_cpu_adam_step_count(engine)
    return ClientState.from_dict(stored or {})


def load_weights_only(engine, plan: LoadPlan) -> None:
    """The module of a module-only `plan` into `engine` (the frozen reference model of DPO/KTO): the same
    reading, re-splitting and checks as a fine-tune's load; no iteration, data position or RNG states."""
    from megatron.checkpointing.loading.module_load import load_module_only
    from megatron.checkpointing.ondisk import forward_validation

    if not plan.module_only:
        raise CheckpointError(f"internal: the reference model loads weights only, but the plan for "
                              f"{plan.tag_dir or plan.load_dir} is a {plan.mode.value} load")
    with checks_beside_use():
        report = load_module_only(engine, _module_weights(plan, engine), strict=plan.strict,
                                  allow_random=plan.allow_random)
    if not report.complete:
        _logger().info(report.describe())
    if plan.validate_forward:
        forward_validation.check(engine, plan.precision, plan.client_state.forward_validation,
                                 source=str(plan.tag_dir))


def load_checkpoint(engine, plan: LoadPlan) -> LoadOutcome | None:
    """Carry out `plan` on `engine`; None when the plan has nothing to load (auto-resume first run)."""
    from megatron.checkpointing.ondisk import forward_validation

    if plan.nothing_to_load:
        return None
    lineage = Lineage()
    if plan.tag_dir is not None:
        if plan.load_optimizer:  # the module-only path checks the files it reads itself
            _verify_files(plan)
        if plan.saves_here:
            # a fine-tune counts from 0 again: the tags before the one it loaded are not its history
            lineage = Lineage(plan.tag, plan.saved_iteration if plan.iteration_from_checkpoint else None)
    module_report = None
    if plan.shape_change is not None:
        from megatron.checkpointing.loading.reshard import resume_at_another_shape

        _check_names_for_resume(plan, engine)
        module_report = resume_at_another_shape(engine, plan.tag_inventory, plan.shape_change, plan.architecture,
                                                _module_weights(plan, engine))
        client_state = plan.client_state
    elif plan.load_optimizer:
        if plan.base is not None:
            from megatron.checkpointing.loading.module_load import load_module_only

            with checks_beside_use():
                module_report = load_module_only(engine, _module_weights(plan, engine))
        client_state = _resume(engine, plan)
    else:
        from megatron.checkpointing.loading.module_load import load_module_only

        with checks_beside_use():
            weights = _module_weights(plan, engine)
            keep_initialised = (REWARD_HEAD if plan.fresh_reward_head else ()) + (ADAPTERS if plan.fresh_adapters else ())
            module_report = load_module_only(engine, weights, strict=plan.strict, allow_random=plan.allow_random,
                                             keep_initialised=keep_initialised)
        if not module_report.complete:
            _logger().info(module_report.describe())
        client_state = plan.client_state
    if plan.validate_forward:
        forward_validation.check(engine, plan.precision, client_state.forward_validation, source=str(plan.tag_dir))
    if plan.restore_rng:
        restore_rng_states(client_state.rng_states[global_rank()])
    iteration = int(plan.saved_iteration) if plan.iteration_from_checkpoint else 0
    train_samples = plan.data_position.consumed_train_samples if plan.iteration_from_checkpoint else 0
    valid_samples = plan.data_position.consumed_valid_samples if plan.iteration_from_checkpoint else 0
    _logger().info(f"loaded {plan.tag_dir or plan.load_dir} ({plan.mode.value}): starting at iteration {iteration}, "
                   f"{train_samples} samples consumed")
    return LoadOutcome(iteration=iteration, consumed_train_samples=train_samples,
                       consumed_valid_samples=valid_samples, loaded_optimizer=plan.load_optimizer,
                       restored_rng=plan.restore_rng, tag=plan.tag, client_state=client_state,
                       lr_schedule_start=plan.lr_schedule_start, lineage=lineage, module_report=module_report,
                       lora_base=plan.lora_base)
