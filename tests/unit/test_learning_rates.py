"""The LR schedule against values worked out by hand from GPT-NeoX's AnnealingLR (step s runs with
the scheduler at n = s - 1)."""

import math

import pytest

from megatron.training.learning_rates import Schedule, learning_rate_at

PEAK, MIN = 1.0e-3, 1.0e-5


def lr(step, style="cosine", warmup=10, decay=110, min_lr=MIN):
    return learning_rate_at(step, peak_lr=PEAK, min_lr=min_lr, warmup_iters=warmup, decay_iters=decay,
                            decay_style=style)


def test_warmup_first_two_steps_share_the_smallest_lr_then_rise_linearly():
    assert lr(1) == lr(2) == pytest.approx(PEAK / 10)
    assert lr(6) == pytest.approx(PEAK / 2)  # n = 5 of 10
    assert lr(11) == pytest.approx(PEAK)  # n = 10: the last warmup value is the peak


def test_fractional_warmup_is_not_rounded():
    # warmup 0.01 of 150 iterations = 1.5: n = 1 is still warmup (1 / 1.5 of the peak), n = 2 decays
    assert lr(2, warmup=1.5, decay=150) == pytest.approx(PEAK / 1.5)
    assert lr(3, "constant", warmup=1.5, decay=150) == PEAK


def test_a_warmup_shorter_than_one_step_never_exceeds_the_peak():
    # warmup 0.01 of a 2-step fine-tune = 0.02 iterations: the first step trains at the peak, not 50x it
    assert lr(1, "constant", warmup=0.02, decay=2) == PEAK
    assert lr(1, "linear", warmup=0.5, decay=2) == PEAK


def test_cosine_midpoint_and_quarter():
    assert lr(61) == pytest.approx((PEAK + MIN) / 2)  # n = 60: half of the 100 decay iterations
    assert lr(36) == pytest.approx(MIN + (PEAK - MIN) * (1 + math.cos(math.pi / 4)) / 2)


def test_cosine_reaches_min_at_decay_iters_and_climbs_back_after_it_as_in_gpt_neox():
    assert lr(111) == pytest.approx(MIN)
    assert lr(161) == pytest.approx((PEAK + MIN) / 2)  # cos(1.5 pi) = 0


def test_linear_decays_towards_zero_and_is_held_at_min_lr():
    assert lr(36, "linear") == pytest.approx(PEAK * 0.75)  # n = 35: a quarter into the decay
    assert lr(36, "linear", min_lr=0.8 * PEAK) == pytest.approx(0.8 * PEAK)
    assert lr(500, "linear") == MIN


def test_exponential_halves_the_peak_over_the_decay():
    assert lr(111, "exponential") == pytest.approx(PEAK * math.exp(-0.693))
    assert lr(61, "exponential") == pytest.approx(PEAK * math.exp(-0.693 / 2))


def test_constant_stays_at_peak_after_warmup():
    assert [lr(s, "constant") for s in (12, 60, 1000)] == [PEAK] * 3


def test_no_warmup_starts_decaying_from_the_first_step():
    assert lr(1, warmup=0) == pytest.approx(PEAK)  # n = 0
    assert lr(2, warmup=0) == pytest.approx(MIN + (PEAK - MIN) * (1 + math.cos(math.pi / 110)) / 2)


def test_schedule_object_gives_the_same_values():
    schedule = Schedule(PEAK, MIN, 10, 110, "linear")
    assert [schedule.lr_at(s) for s in (1, 30, 90)] == [lr(s, "linear") for s in (1, 30, 90)]


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="lr_decay_style"):
        lr(5, style="inverse_sqrt")
    with pytest.raises(ValueError, match="counted from 1"):
        lr(0)
