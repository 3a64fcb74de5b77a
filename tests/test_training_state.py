"""Where training continues after a load: iteration, data position and the LR schedule's step."""

from megatron.checkpointing import ClientState, LoadOutcome
from megatron.training import TrainState, state_after_load


def outcome(iteration, loaded_optimizer, lr_schedule_start=0):
    return LoadOutcome(iteration=iteration, consumed_train_samples=iteration * 8, loaded_optimizer=loaded_optimizer,
                       restored_rng=False, tag=f"global_step{iteration}",
                       client_state=ClientState(iteration=iteration, lr_schedule_start=lr_schedule_start))


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
