"""Where training continues after a load: iteration, data position and the LR schedule's step."""

from megatron.checkpointing import ClientState, LoadMode, LoadOutcome
from megatron.checkpointing.planning.plan import schedule_start
from megatron.training.loop import TrainState, state_after_load


def outcome(iteration, loaded_optimizer, lr_schedule_start=0):
    """What load_checkpoint returns after a full resume, a no_load_optim load (iteration > 0) or a fine-tune."""
    mode = LoadMode.RESUME if loaded_optimizer else LoadMode.NO_LOAD_OPTIM if iteration else LoadMode.FINETUNE
    client = ClientState(iteration=iteration, lr_schedule_start=lr_schedule_start)
    return LoadOutcome(iteration=iteration, consumed_train_samples=iteration * 8, loaded_optimizer=loaded_optimizer,
                       restored_rng=False, tag=f"global_step{iteration}", client_state=client,
                       lr_schedule_start=schedule_start(mode, iteration, client))


def test_a_fresh_run_takes_schedule_step_1_first():
    assert TrainState().lr_step == 1


def test_resume_continues_the_saved_schedule():
    state = state_after_load(outcome(20, True, lr_schedule_start=0))
    assert (state.iteration, state.consumed_train_samples, state.lr_step) == (20, 160, 21)


def test_resume_of_a_run_that_began_with_no_load_optim_keeps_that_runs_schedule():
    state = state_after_load(outcome(30, True, lr_schedule_start=20))
    assert (state.iteration, state.lr_step) == (30, 11)


def test_no_load_optim_keeps_iteration_and_data_position_but_restarts_the_schedule():
    state = state_after_load(outcome(20, False))
    assert (state.iteration, state.consumed_train_samples, state.lr_step) == (20, 160, 1)


def test_finetune_starts_everything_at_zero():
    state = state_after_load(outcome(0, False))
    assert (state.iteration, state.consumed_train_samples, state.lr_step) == (0, 0, 1)


# --- override_lr_scheduler / use_checkpoint_lr_scheduler, as GPT-NeoX's AnnealingLR decides ----------

def _run_settings(**overrides):
    from megatron.neox_arguments import NeoXArgs

    return NeoXArgs.from_dict({"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 4,
                               "train_iters": 100, "lr": 0.001, "warmup": 0.1, **overrides})


SAVED = {"peak_lr": 0.002, "min_lr": 0.0, "warmup_iters": 10.0, "decay_iters": 100, "decay_style": "linear"}


def _resume(args, saved=SAVED):
    from megatron.training.learning_rates import Schedule

    return state_after_load(LoadOutcome(
        iteration=20, consumed_train_samples=160, loaded_optimizer=True, restored_rng=True, tag="global_step20",
        client_state=ClientState(iteration=20, lr_schedule=saved), lr_schedule_start=0), Schedule.from_args(args),
        args.override_lr_scheduler, args.use_checkpoint_lr_scheduler)


def test_resume_with_a_changed_schedule_is_refused_by_default():
    import pytest

    from megatron.neox_arguments import ConfigError

    with pytest.raises(ConfigError, match=r"peak_lr 0.002 -> 0.001.*override_lr_scheduler.*use_checkpoint_lr_scheduler"):
        _resume(_run_settings())


def test_override_lr_scheduler_takes_the_configs_schedule():
    schedule = _resume(_run_settings(override_lr_scheduler=True)).schedule
    assert schedule.peak_lr == 0.001 and schedule.lr_at(21) == 0.001 * 80 / 90  # linear, n = 20 of 10..100


def test_use_checkpoint_lr_scheduler_takes_the_checkpoints_schedule():
    schedule = _resume(_run_settings(use_checkpoint_lr_scheduler=True)).schedule
    assert schedule.peak_lr == 0.002 and schedule.lr_at(21) == 0.002 * 80 / 90


def test_an_unchanged_schedule_or_one_never_recorded_resumes_without_a_flag():
    assert _resume(_run_settings(lr=0.002)).schedule.peak_lr == 0.002
    assert _resume(_run_settings(), saved=None).schedule.peak_lr == 0.001


def test_periodic_saves_start_after_the_first_step_and_extra_save_iters_may_ask_for_iteration_0():
    from types import SimpleNamespace

    from megatron.training.loop import _should_save

    periodic = SimpleNamespace(save="ckpt", checkpoint_factor=2, extra_save_iters=None)
    assert [step for step in range(5) if _should_save(periodic, step)] == [2, 4]
    extra = SimpleNamespace(save="ckpt", checkpoint_factor=2, extra_save_iters=[0, 3])
    assert [step for step in range(5) if _should_save(extra, step)] == [0, 2, 3, 4]


def test_the_loads_lineage_is_the_one_the_runs_saves_add_to():
    """save_checkpoint prunes only the tags of state.lineage: the loaded tag and those before it come from the load."""
    loaded = outcome(20, True)
    assert state_after_load(loaded).lineage is loaded.lineage
    fresh = TrainState().lineage  # a run that loaded nothing owns no tag yet
    assert (fresh.loaded_tag, fresh.saved) == (None, set())
