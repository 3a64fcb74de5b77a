import math

import pytest

from megatron.learning_rates import learning_rate_at

PEAK, MIN = 1.0e-3, 1.0e-5


def lr(step, style="cosine", warmup=10, decay=110):
    return learning_rate_at(step, peak_lr=PEAK, min_lr=MIN, warmup_iters=warmup, decay_iters=decay,
                            decay_style=style)


def test_warmup_is_linear_from_the_first_step():
    assert lr(1) == pytest.approx(PEAK / 10)
    assert lr(5) == pytest.approx(PEAK / 2)
    assert lr(10) == pytest.approx(PEAK)


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_decay_reaches_min_lr_at_decay_iters_and_stays(style):
    assert lr(110, style) == pytest.approx(MIN)
    assert lr(500, style) == pytest.approx(MIN)


def test_cosine_midpoint_is_halfway_between_peak_and_min():
    assert lr(60) == pytest.approx((PEAK + MIN) / 2)


def test_cosine_value_at_a_quarter_of_the_decay():
    expected = MIN + (PEAK - MIN) * (1 + math.cos(math.pi * 0.25)) / 2
    assert lr(35) == pytest.approx(expected)


def test_linear_decay_at_a_quarter():
    assert lr(35, "linear") == pytest.approx(MIN + (PEAK - MIN) * 0.75)


def test_constant_stays_at_peak_after_warmup():
    assert [lr(s, "constant") for s in (11, 60, 1000)] == [PEAK] * 3


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_decay_never_increases(style):
    values = [lr(s, style) for s in range(10, 200)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_no_warmup_starts_at_peak():
    assert lr(1, warmup=0) == pytest.approx(MIN + (PEAK - MIN) * (1 + math.cos(math.pi / 110)) / 2)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="lr_decay_style"):
        lr(5, style="exponential")
    with pytest.raises(ValueError, match="counted from 1"):
        lr(0)
