"""Set-up (tokenizer, data, model, optimizer, engine, checkpoint) and the train/eval loop."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing import (
    Lineage,
    LoraBase,
    ReferenceIdentity,
    samples_per_evaluation,
    tag_for_iteration,
)
from megatron.logging import (
    get_logger,
    quiet_deepspeed,
    slow_stage,
    tee_output_to,
)
from megatron.optim.optimizers import build_param_groups
from megatron.ranks import (
    data_parallel_rank_and_size,
    global_rank,
    replicas_and_context_parallel_size,
    tensor_parallel_rank,
)
from megatron.runtime import faults
from megatron.runtime.initialize import (
    ModelParallelUnit,
    initialize_distributed,
    set_seeds,
    zero3_construction,
)
from megatron.runtime.stop_signals import StopSignals, hold_before_save, signal_name
from megatron.training.divergence import DivergenceSettings, check_weights_finite
from megatron.training.learning_rates import Schedule, schedule_for_resume, set_learning_rate
from megatron.training.loop_settings import LoopSettings
from megatron.training.watchers import StepWatchers


@dataclass
class ReferenceModel:
    """A frozen model and which weights it is (every save records them): the reference DPO, KTO and REINFORCE
    compare the policy with, or the reward model scoring REINFORCE's completions."""

    engine: Any  # called as a forward-only engine, eval mode, no parameter requires grad; None: precomputed
    identity: ReferenceIdentity


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0  # where the next evaluation's validation batches start
    # The iteration the LR schedule counts from: 0, except after `no_load_optim`, whose fresh
    # optimizer starts a fresh schedule (warmup included) while the iteration count carries on.
    lr_schedule_start: int = 0
    schedule: Schedule | None = None  # what the LR follows; None until the run's settings decide it
    # fp16 steps skipped for overflow since the optimizer (and its schedule) started: DeepSpeed's count,
    # restored by a full resume. They do not advance the schedule: GPT-NeoX's DeepSpeed steps its LR
    # scheduler only after a step it applied.
    skipped_steps: int = 0
    lineage: Lineage = field(default_factory=Lineage)  # the tags of `save` this run may prune
    reference: ReferenceModel | None = None  # DPO/KTO's frozen reference; its identity goes into every save
    lora_base: LoraBase | None = None  # a LoRA run's frozen base: set, its saves are adapter-only and name it
    rollouts: Any = None  # REINFORCE's rollout source (megatron.rollouts): its state goes into every save
    reward_model: ReferenceModel | None = None  # REINFORCE's scorer (`reward_model`); its identity goes into every save

    @property
    def lr_step(self) -> int:
        """The schedule's step number of the optimizer step about to be taken."""
        return self.iteration + 1 - self.lr_schedule_start - self.skipped_steps


def state_after_load(outcome, schedule: Schedule | None = None, override_lr_scheduler: bool = False,
                     use_checkpoint_lr_scheduler: bool = False) -> TrainState:
    """Where training continues after `load_checkpoint`: the plan decided iteration, data position and the
    iteration the LR schedule counts from.

    With the configs' `schedule`, also the LR schedule: a full resume checks it against the one the checkpoint
    recorded (override_lr_scheduler / use_checkpoint_lr_scheduler decide, as in GPT-NeoX).
    """
    if outcome.loaded_optimizer and schedule is not None:
        schedule = _resumed_schedule(schedule, outcome.client_state.lr_schedule, override_lr_scheduler,
                                     use_checkpoint_lr_scheduler)
    return TrainState(iteration=outcome.iteration, consumed_train_samples=outcome.consumed_train_samples,
                      consumed_valid_samples=outcome.consumed_valid_samples,
                      lr_schedule_start=outcome.lr_schedule_start, schedule=schedule, lineage=outcome.lineage,
                      lora_base=outcome.lora_base)


def _resumed_schedule(configured: Schedule, saved: dict | None, override_lr_scheduler: bool,
                      use_checkpoint_lr_scheduler: bool) -> Schedule:
    from megatron.neox_arguments import ConfigError

    try:
        schedule, line = schedule_for_resume(configured, saved, override=override_lr_scheduler,
                                             use_checkpoint=use_checkpoint_lr_scheduler)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if line:
        get_logger().info(line)
    return schedule


@dataclass
class RunResult:
    """What a finished run reports (the last losses), for callers and tests."""

    iteration: int
    last_train_loss: float | None
    last_valid_loss: float | None
    test_loss: float | None


def batch_options_for(args):
    """How batches are formed: the settings that need the tokenizer's eod id get it."""
    from megatron.data import BatchOptions
    from megatron.tokenizer import build_tokenizer

    needs_eod = args.eod_mask_loss or args.reset_position_ids or args.reset_attention_mask
    return BatchOptions.from_args(args, build_tokenizer(args).eod if needs_eod else None)


def train_step(engine, train_iterator, objective, before_optimizer_step=None) -> tuple[float, dict[str, float]]:
    """One optimizer step: ``gradient_accumulation_steps`` micro batches, then DeepSpeed steps.

    Returns the loss and the objective's metrics, averaged. `before_optimizer_step` runs after the last
    backward, when the step's gradients are complete.
    """
    from megatron.objectives import mean_over_micro_batches_and_ranks

    results = []
    micro_batches = engine.gradient_accumulation_steps()
    for micro_batch in range(micro_batches):
        loss, metrics = objective(engine, next(train_iterator))
        engine.backward(loss)
        if before_optimizer_step is not None and micro_batch == micro_batches - 1:
            before_optimizer_step()
        engine.step()
        results.append((loss, metrics))
    return mean_over_micro_batches_and_ranks(results)


@torch.no_grad()
def evaluate(engine, iterator, eval_iters: int, objective) -> tuple[float, dict[str, float]]:
    """The loss and metrics over `eval_iters` batches; a batch is gradient_accumulation_steps micro batches, as
    in GPT-NeoX (and DeepSpeed's pipeline engine), so an evaluation reads eval_iters x train_batch_size samples."""
    from megatron.objectives import mean_over_micro_batches_and_ranks

    engine.eval()
    results = [objective(engine, next(iterator)) for _ in range(eval_iters * engine.gradient_accumulation_steps())]
    engine.train()
    return mean_over_micro_batches_and_ranks(results)


def missing_evaluation_notes(loop: LoopSettings, valid_iterator, test_iterator) -> list[str]:
    """What a run that would evaluate cannot, for want of data: said once before the first step, not silently."""
    def why(split: str) -> str:
        if loop.train_impl == "reinforce":
            return "train_impl reinforce does not evaluate yet"
        if loop.data_path:
            return f"split {loop.split!r} of data_path gives it no documents"
        return f"{split}_data_paths is not set"

    notes = []
    if loop.eval_iters > 0 and valid_iterator is None and loop.eval_interval <= loop.train_iters:
        notes.append(f"no validation data ({why('valid')}): no evaluation every {loop.eval_interval} steps")
    if loop.eval_iters > 0 and test_iterator is None:
        notes.append(f"no test data ({why('test')}): no test evaluation at the end")
    return notes


def _evaluation_scalars(split: str, loss: float, metrics: dict[str, float], objective) -> dict[str, float]:
    scalars = {f"{split}/loss": loss, **{f"{split}/{name}": value for name, value in metrics.items()}}
    if objective.reports_perplexity:
        scalars[f"{split}/ppl"] = _perplexity(loss)
    return scalars


def _evaluation_line(loss: float, metrics: dict[str, float], objective) -> str:
    parts = [f"loss {loss:.4f}", *(f"{name} {metrics[name]:.4f}" for name in objective.metric_names)]
    if objective.reports_perplexity:
        parts.append(f"perplexity {_perplexity(loss):.2f}")
    return " | ".join(parts)


def _should_save(loop: LoopSettings, iteration: int) -> bool:
    if not loop.save:
        return False
    every_factor = bool(loop.checkpoint_factor) and iteration > 0 and iteration % loop.checkpoint_factor == 0
    return every_factor or iteration in (loop.extra_save_iters or ())


def _save(args, engine, state: TrainState) -> Path:
    from megatron.checkpointing import save_checkpoint

    check_weights_finite(engine, state.iteration, DivergenceSettings.from_args(args))
    return save_checkpoint(args, engine, state.iteration, state.consumed_train_samples, state.lr_schedule_start,
                           lr_schedule=state.schedule.to_dict(), consumed_valid_samples=state.consumed_valid_samples,
                           lineage=state.lineage,
                           reference_model=state.reference.identity.to_dict() if state.reference else None,
                           lora_base=state.lora_base.to_dict() if state.lora_base else None,
                           rollouts=state.rollouts.state_dict() if state.rollouts is not None else None,
                           reward_model=state.reward_model.identity.to_dict() if state.reward_model else None)


def _stop_after_signal(save: str | None, save_now, state: TrainState, signum: int, saved_at: int | None) -> None:
    """The graceful end of a run stopped by SIGTERM/SIGINT: a checkpoint of this step (`save_now` writes it into
    `save` and returns its tag's path), one line."""
    from megatron.checkpointing import wait_for_save_in_flight

    if not save:
        outcome = "no checkpoint saved (`save` is not set)"
    elif saved_at == state.iteration:
        outcome = f"checkpoint saved to {Path(save) / tag_for_iteration(state.iteration)}"
    else:
        hold_before_save()
        outcome = f"checkpoint saved to {save_now()}"
    wait_for_save_in_flight()  # the line says saved once the tag is committed
    get_logger().info(f"stopped by {signal_name(signum)} at iteration {state.iteration}; {outcome}")


def setup(args):
    """Everything before the first step; returns (engine, state, iterators)."""
    from megatron.checkpointing import (
        LoadSettings,
        check_save_dir,
        checks_beside_use,
        load_checkpoint,
        needs_reference,
        plan_load_for,
    )
    from megatron.data.builders import build_checked_datasets, data_iterators, samples_per_split
    from megatron.data.data_settings import DataSettings
    from megatron.hf import HF_FOLDER
    from megatron.neox_arguments import ConfigError, NeoXArgs
    from megatron.objectives.precomputed_reference import PrecomputeSettings
    from megatron.tokenizer import build_tokenizer

    if not args.requires_run_settings:  # files for generate.py / eval.py: what training needs was not required of them
        NeoXArgs.from_dict(args.given, "the config files (text_gen_type or eval_tasks is set, as for generate.py "
                           "or eval.py)",
                           require_run_settings=True)
    if args.log_dir:
        tee_output_to(args.log_dir)
    quiet_deepspeed()
    initialize_distributed(args)
    dp_rank, dp_size = data_parallel_rank_and_size()  # the samples: every context-parallel rank reads its replica's
    partitions = replicas_and_context_parallel_size()  # the ZeRO partitions a checkpoint holds
    if args.padded_vocab_size is None:
        raise ConfigError("padded_vocab_size is not resolved: start training through deepy.py, which resolves the "
                          "tokenizer and the embedded corpus once (megatron.launch.run_context.resolve_run_settings)")
    # before the model: a data file that cannot train stops the run before the slow part of the start
    data_settings = DataSettings.from_args(args)
    datasets = (None, None, None) if reads_data_server(args.train_impl, args.dataset_impl) else \
        build_checked_datasets(data_settings, build_tokenizer(args).vocab_size, samples_per_split(data_settings))
    # the checkpoint files read from here on are checked in a thread while the engine is built and loaded;
    # the block ends with their checks, before any step
    with checks_beside_use():
        load_settings = LoadSettings.from_args(args)
        plan = plan_load_for(load_settings, partitions, hf_source=HF_FOLDER)
        reference_plan, reference_identity = _planned_reference(needs_reference(args), load_settings,
                                                                PrecomputeSettings.from_args(args), plan, partitions)
        reward_plan, reward_identity = _planned_reward_model(args, load_settings, plan, partitions)
        check_save_dir(args)
        engine = _built_engine(args, dp_size)
        state = TrainState(schedule=Schedule.from_args(args))
        restored_rng = False
        saved_rollouts = None
        if plan is not None:
            outcome = load_checkpoint(engine, plan)
            if outcome is not None:
                state = state_after_load(outcome, state.schedule, args.override_lr_scheduler,
                                         args.use_checkpoint_lr_scheduler)
                restored_rng = outcome.restored_rng
                saved_rollouts = outcome.client_state.rollouts if restored_rng else None
        state.reference = _reference_model(args, engine, reference_plan, reference_identity)
        state.reward_model = _reward_model(args, reward_plan, reward_identity)
    if not restored_rng:
        # Same weights on every rank came from the shared seed above; dropout differs per rank.
        set_seeds(args.seed + 1 + dp_rank)
    iterators = data_iterators(data_settings, datasets, dp_rank, dp_size, state.consumed_train_samples,
                               state.consumed_valid_samples)
    if args.train_impl == "reinforce":
        iterators = _rollouts(args, engine, iterators, state, saved_rollouts, dp_rank, dp_size)
    return engine, state, iterators


def _planned_reference(live: bool, load_settings, precompute, plan, dp_size: int):
    """The DPO/KTO/REINFORCE reference this run compares against: (its load plan, its identity), said in one line;
    (None, identity) for precomputed log-probabilities; (None, None) without a reference. `live`: the objective
    runs a frozen reference model (needs_reference)."""
    from megatron.checkpointing import describe_reference, plan_reference
    from megatron.hf import HF_FOLDER
    from megatron.objectives.precomputed_reference import precomputed_reference

    if live:
        reference_plan, identity = plan_reference(load_settings, plan, dp_size, hf_source=HF_FOLDER)
        get_logger().info(describe_reference(identity, resumed=reference_plan is not plan,
                                             adapters_off=load_settings.lora_rank > 0))
        return reference_plan, identity
    precomputed = precomputed_reference(precompute, load_settings, plan, dp_size, hf_source=HF_FOLDER)
    if precomputed is not None:
        get_logger().info(f"precomputed reference log-probabilities ({precompute.precompute_model_name}) of "
                          f"{precomputed.path}, checksum {precomputed.checksum}: this run's reference; "
                          "recorded in every save")
    return None, precomputed


def _reference_model(args, engine, reference_plan, identity) -> ReferenceModel | None:
    """The frozen reference: with LoRA the run's own base with its adapters off, else a model of its own
    (`frozen_reference_engine`) loaded by `reference_plan`; precomputed log-probabilities need none."""
    from megatron.checkpointing import load_weights_only
    from megatron.model.lora import BaseWithoutAdapters

    if identity is None:
        return None
    if reference_plan is None:
        return ReferenceModel(None, identity)
    if args.lora_rank:
        return ReferenceModel(BaseWithoutAdapters(engine), identity)
    reference = frozen_reference_engine(args)
    load_weights_only(reference, reference_plan)
    return ReferenceModel(reference, identity)


def _planned_reward_model(args, load_settings, plan, dp_size: int):
    """(its load plan, its identity) of the reward model scoring REINFORCE's completions; (None, None) without one."""
    from megatron.checkpointing import describe_reward_model, plan_reward_model
    from megatron.hf import HF_FOLDER

    if args.train_impl != "reinforce" or not args.reward_model:
        return None, None
    reward_plan, identity = plan_reward_model(load_settings, args.reward_model, _reward_model_architecture(args),
                                              args.tokenizer_type, plan, dp_size, hf_source=HF_FOLDER)
    get_logger().info(describe_reward_model(identity))
    return reward_plan, identity


def _reward_model_architecture(args):
    """The policy's model with the scalar head of train_impl rm in place of its output layer."""
    import dataclasses

    return dataclasses.replace(args.architecture(), reward_head=True)


def _reward_model(args, reward_plan, identity) -> ReferenceModel | None:
    """The reward model, built and loaded as a frozen reference is (`frozen_reference_engine`)."""
    from megatron.checkpointing import load_weights_only

    if reward_plan is None:
        return None
    engine = frozen_reference_engine(args, _reward_model_architecture(args))
    load_weights_only(engine, reward_plan)
    return ReferenceModel(engine, identity)


def _built_engine(args, dp_size: int):
    """The model and its DeepSpeed engine (the pipe engine with pipeline stages), from the shared seed."""
    import deepspeed

    from megatron.model import build_model
    from megatron.training.pipe_engine import build_pipeline_engine

    set_seeds(args.seed)
    ds_config = args.deepspeed_config()
    # Under ZeRO-3 no rank ever holds the whole model: it is built partitioned over the data-parallel group.
    partitioned_by = zero3_construction(ds_config) if args.zero_stage == 3 else None
    with slow_stage("building the model and its DeepSpeed engine (a first run also builds DeepSpeed's optimizer op)"):
        if args.pipe_parallel_size > 1:
            engine = build_pipeline_engine(args, ds_config)
        else:
            model = build_model(args.architecture(), args.seed, partitioned_by=partitioned_by, lora=args.lora())
            engine, _, _, _ = deepspeed.initialize(model=model,
                                                   model_parameters=build_param_groups(model, args.weight_decay),
                                                   config=ds_config, mpu=ModelParallelUnit())
    _log_model(args, engine.module, args.zero_stage, dp_size, args.pipe_parallel_size)
    if args.torch_compile:
        engine.compile()  # compiles the module in place: parameter and checkpoint names stay as they are
    return engine


def _rollouts(args, engine, iterators, state: TrainState, saved: list | None, dp_rank: int, dp_size: int):
    """REINFORCE's iterators; a full resume at the saving run's rank count continues its rollout state."""
    from megatron.rollouts import rollout_iterators

    iterators = rollout_iterators(args, engine, iterators, state.iteration, dp_rank, dp_size, tensor_parallel_rank(),
                                  state.reward_model.engine if state.reward_model else None)
    state.rollouts = iterators[0]
    if saved is not None and len(saved) == torch.distributed.get_world_size():
        state.rollouts.load_state_dict(saved[global_rank()])
    elif saved is not None:
        get_logger().info(f"the checkpoint holds the rollout state of {len(saved)} ranks, this run has "
                          f"{torch.distributed.get_world_size()}: its rollouts differ from the unbroken run's")
    return iterators


def reads_data_server(train_impl: str, dataset_impl: str) -> bool:
    """REINFORCE's scored completions come from GPT-NeoX's data server: no data files are read."""
    return train_impl == "reinforce" and dataset_impl == "online"


def frozen_reference_engine(args, architecture=None):
    """The policy's model (or `architecture`: the reward model's) built again (the same tensor-parallel layout,
    partitioned under ZeRO-3 as the policy is, its random layers drawn from the same seed), frozen, in a
    forward-only engine of the run's precision, in eval mode; its weights are loaded after."""
    import deepspeed

    from megatron.model import build_model
    from megatron.neox_arguments.deepspeed_config import build_inference_deepspeed_config

    partitioned = args.zero_stage == 3
    config = build_inference_deepspeed_config(args.to_dict(), partitioned=partitioned)
    with torch.random.fork_rng(devices=[]):  # the policy's dropout and data draws stay as without a reference
        model = build_model(architecture or args.architecture(), args.seed,
                            partitioned_by=zero3_construction(config) if partitioned else None)
    model.requires_grad_(False)
    # Without an optimizer DeepSpeed's ZeRO-3 engine only gathers each layer's partitions for its forward.
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=ModelParallelUnit())
    engine.eval()
    return engine


def _log_model(args, model, zero_stage: int, dp_size: int, pipeline_stages: int) -> None:
    from megatron.model.attention import attention_path

    get_logger().info(f"model: {sum(getattr(p, 'ds_numel', p.numel()) for p in model.parameters()):,} parameters per "
                      f"tensor-parallel rank, precision {args.precision}, ZeRO stage {zero_stage}, {dp_size} "
                      f"data-parallel rank(s) x {args.model_parallel_size} tensor-parallel"
                      + (f" x {args.context_parallel_size} context-parallel" if args.context_parallel_size > 1 else "")
                      + (f" x {pipeline_stages} pipeline stages (the count is the first stage's)"
                         if pipeline_stages > 1 else "")
                      + (f"; {sum(getattr(p, 'ds_numel', p.numel()) for p in model.parameters() if p.requires_grad):,} "
                         "of them train "
                         "(LoRA adapters; the rest are frozen)" if args.lora_rank else ""))
    get_logger().info(attention_path(args.architecture(), args.reset_attention_mask))


def setup_for_inference(args):
    """The checkpoint named by `load` in an engine that only runs forward (generation, evaluation), in eval mode.

    Loaded by the training load plan as a fine-tune loads it, weights only, so any checkpoint a run can
    start from (ours at any tensor-parallel size, GPT-NeoX's, a Hugging Face folder) can be sampled; the
    optimizer, data and save directory are never touched.
    """
    import deepspeed

    from megatron.checkpointing import LoadSettings, load_checkpoint, plan_load_for
    from megatron.hf import HF_FOLDER
    from megatron.model import build_model
    from megatron.neox_arguments import ConfigError
    from megatron.neox_arguments.deepspeed_config import build_inference_deepspeed_config

    if args.log_dir:
        tee_output_to(args.log_dir)
    quiet_deepspeed()
    if args.padded_vocab_size is None:
        raise ConfigError("padded_vocab_size is not resolved: start generate.py / eval.py through deepy.py, which resolves the "
                          "tokenizer once (megatron.launch.run_context.resolve_run_settings)")
    stated_by = "generate.py / eval.py (loads the weights only)"
    if args.context_parallel_size > 1:
        raise ConfigError(f"{stated_by}: context_parallel_size {args.context_parallel_size} splits training "
                          "sequences; set context_parallel_size: 1 (a checkpoint does not depend on it)")
    initialize_distributed(args)
    if not args.load:
        raise ConfigError(f"{stated_by}: finetune: set but `load` is not; say which checkpoint to load")
    weights_only = LoadSettings.from_args(args).weights_only(stated_by)
    plan = plan_load_for(weights_only, data_parallel_rank_and_size()[1], hf_source=HF_FOLDER)
    set_seeds(args.seed)
    model = build_model(args.architecture(), args.seed, lora=args.lora())
    _log_model(args, model, 0, data_parallel_rank_and_size()[1], pipeline_stages=1)  # every rank runs the whole model
    engine, _, _, _ = deepspeed.initialize(model=model, config=build_inference_deepspeed_config(args.to_dict()),
                                           mpu=ModelParallelUnit())
    load_checkpoint(engine, plan)
    engine.eval()
    return engine


def train(args, engine, state: TrainState, iterators, stop_signals: StopSignals | None = None,
          objective=None) -> RunResult:
    """The training loop; `objective` (default: the one `train_impl` names) gives each micro batch's loss.
    However it ends (done, stopped by a signal, diverged), not before the save in flight."""
    from megatron.checkpointing import saves_waited_for

    with saves_waited_for():
        return _train(args, engine, state, iterators, stop_signals, objective)


def _train(args, engine, state: TrainState, iterators, stop_signals: StopSignals | None, objective) -> RunResult:
    from megatron.checkpointing import check_save_in_flight
    from megatron.objectives import objective_for
    from megatron.training import pipe_engine as pipeline

    step_on, evaluate_on = (pipeline.train_step, pipeline.evaluate) if pipeline.is_pipelined(engine) else (
        train_step, evaluate)
    stop = _agreed_stop(stop_signals)
    if stop is not None:  # asked for during set-up: no step taken, nothing to save
        get_logger().info(f"stopped by {signal_name(stop)} at iteration {state.iteration}, before the first step "
                          "of this run; nothing to save")
        return RunResult(state.iteration, None, None, None)
    train_iterator, valid_iterator, test_iterator = iterators
    loop = LoopSettings.from_args(args)
    for note in missing_evaluation_notes(loop, valid_iterator, test_iterator):
        get_logger().info(note)
    objective = objective or objective_for(args, batch_options_for(args),
                                           state.reference.engine if state.reference else None)
    state.schedule = state.schedule or Schedule.from_args(args)
    if state.iteration == 0 and _should_save(loop, 0):
        _save(args, engine, state)  # extra_save_iters may ask for the untrained model
    start_iteration = state.iteration
    last_train_loss = last_valid_loss = saved_at = None
    watchers = StepWatchers(args, engine, objective.metric_names, state.iteration)
    try:
        engine.train()
        while state.iteration < loop.train_iters and stop is None:
            step = state.iteration + 1
            last_train_loss = _one_step(loop.train_batch_size, engine, state, lambda: step_on(
                engine, train_iterator, objective, watchers.before_optimizer_step()), watchers)
            if valid_iterator is not None and loop.eval_interval and step % loop.eval_interval == 0:
                last_valid_loss = _validate(loop, engine, state, valid_iterator, objective, evaluate_on, watchers)
            check_save_in_flight()
            if _should_save(loop, step) and step != loop.train_iters:
                _save(args, engine, state)
                saved_at = step
            faults.fail_point(global_rank(), step)
            stop = _agreed_stop(stop_signals, step)
        watchers.end_steps()
        if stop is not None:
            _stop_after_signal(loop.save, lambda: _save(args, engine, state), state, stop, saved_at)
            return RunResult(state.iteration, last_train_loss, last_valid_loss, None)
        if loop.save and state.iteration > start_iteration:
            _save(args, engine, state)
        test_loss = None
        if test_iterator is not None and loop.eval_iters > 0:
            test_loss, test_metrics = evaluate_on(engine, test_iterator, loop.eval_iters, objective)
            watchers.metrics.write(_evaluation_scalars("test", test_loss, test_metrics, objective), state.iteration)
            get_logger().info(f"test: {_evaluation_line(test_loss, test_metrics, objective)}")
        return RunResult(state.iteration, last_train_loss, last_valid_loss, test_loss)
    finally:
        watchers.close()


def _agreed_stop(stop_signals: StopSignals | None, after_iteration: int | None = None) -> int | None:
    return stop_signals.agreed_stop(after_iteration) if stop_signals is not None else None


def _one_step(train_batch_size: int, engine, state: TrainState, take_step, watchers: StepWatchers) -> float:
    """One optimizer step at the schedule's learning rate; the state advanced and the watchers fed."""
    state.skipped_steps = engine.skipped_steps
    lr = state.schedule.lr_at(state.lr_step)
    set_learning_rate(engine.optimizer, lr)
    started = time.perf_counter()
    watchers.before_step(state.iteration)
    loss, step_metrics = take_step()
    state.iteration += 1
    state.consumed_train_samples += train_batch_size
    watchers.after_step(state.iteration, loss, step_metrics, lr, time.perf_counter() - started)
    return loss


def _validate(loop: LoopSettings, engine, state: TrainState, valid_iterator, objective, evaluate_on,
              watchers: StepWatchers) -> float:
    loss, metrics = evaluate_on(engine, valid_iterator, loop.eval_iters, objective)
    state.consumed_valid_samples += samples_per_evaluation(loop.eval_iters, loop.train_batch_size)
    watchers.evaluation(state.iteration, _evaluation_scalars("valid", loss, metrics, objective),
                        f"validation at iteration {state.iteration}: {_evaluation_line(loss, metrics, objective)}")
    return loss


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def pretrain(args, stop_signals: StopSignals | None = None) -> RunResult:
    """Set up and train; `stop_signals` (installed here when not given) ends the run after a step."""
    if stop_signals is None:
        stop_signals = StopSignals()
        stop_signals.install()
    engine, state, iterators = setup(args)
    stop_signals.hold_before_first_step()
    return train(args, engine, state, iterators, stop_signals)
