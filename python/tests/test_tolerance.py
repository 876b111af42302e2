"""The tolerance rule (tolerance.py) is tight enough that a real error fails it: the bound is
the size of what is compared times the rounding its operations explain, and a training run
whose learning rate is off by 1% parts from the reference by several times the per-step bound
that the comparisons of plans, restores and ZeRO-1 against one process use."""

from __future__ import annotations

import math

import pytest

from launcher import DATA, single_process
from tolerance import EPS32, assert_close_rel, assert_steps_close, bound, excess, layers_of, loss_ops, step_ops

MODEL = DATA / "tiny-llama.yaml"


def test_the_bound_is_relative_to_the_size_of_what_is_compared():
    assert bound([3.0, -8.0], 10) == 10 * EPS32 * 8.0
    assert bound([1e-9], 10, scale=2.0) == 10 * EPS32 * 2.0
    assert excess([8.0 + 40 * EPS32], [8.0], 10) == pytest.approx(0.5)
    assert_close_rel([8.0 + 40 * EPS32], [8.0], 10, "x")
    with pytest.raises(AssertionError, match=r"^y: differs by .*, over the bound 10 x eps 1.19e-07 x max\|expected\| 8 "
                                             r"= .* \(1.5 times it\)$"):
        assert_close_rel([8.0 + 120 * EPS32], [8.0], 10, "y")
    with pytest.raises(AssertionError, match="shapes differ"):
        excess([1.0, 2.0], [1.0], 1)
    assert excess(0.0, 0.0, 0) == 0.0 and excess(1e-30, 0.0, 0) == math.inf


def test_a_learning_rate_off_by_one_percent_fails_the_per_step_bound():
    """The same model and data, the learning rate 1.01e-3 for 1e-3: from step 1 on the losses
    part by more than the rounding bound (today by 1.2 times it at step 1 and 12 times at step
    19), while the identical run passes it."""
    layers = layers_of(MODEL)
    want = single_process(str(MODEL), 8, 16, 20, 3, extra=["--lr", "1e-3"])
    assert_steps_close(single_process(str(MODEL), 8, 16, 20, 3, extra=["--lr", "1e-3"]), want, layers, "the same run")
    off = single_process(str(MODEL), 8, 16, 20, 3, extra=["--lr", "1.01e-3"])
    per_step = [excess(a, b, step_ops(i, layers)) for i, (a, b) in enumerate(zip(off, want))]
    assert per_step[0] <= 1.0, "step 0 comes before the first update"
    assert per_step[1] > 1.0 and max(per_step) > 8.0, per_step
    with pytest.raises(AssertionError, match="lr off by 1%, step 1: differs by"):
        assert_steps_close(off, want, layers, "lr off by 1%")


def test_the_step_bound_grows_as_a_random_walk_of_updates():
    assert step_ops(0, 4) == loss_ops(4) == 44
    assert step_ops(9, 4) == 44 + 3 * 126
    with pytest.raises(AssertionError, match="3 steps against 2"):
        assert_steps_close([1.0, 1.0, 1.0], [1.0, 1.0], 4, "z")
