"""Sweep statistics: spread over seeds and the paired difference with its t interval."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from fira_train.sweep.stats import paired_difference, spread


def test_spread_is_mean_and_sample_sd() -> None:
    s = spread([1.0, 2.0, 3.0])
    assert (s.mean, s.sd, s.n) == (2.0, 1.0, 3)
    assert spread([5.0]).sd is None
    with pytest.raises(ValueError, match="at least one"):
        spread([])


def test_paired_interval_matches_scipys_paired_t_test() -> None:
    x = {0: 110.5, 1: 112.25, 2: 109.0, 3: 111.0}
    y = {0: 108.0, 1: 111.5, 2: 108.75, 3: 107.5, 9: 1.0}  # seed 9 has no partner: left out
    d = paired_difference(x, y)
    reference = stats.ttest_rel([x[s] for s in range(4)], [y[s] for s in range(4)]).confidence_interval(0.95)
    assert d is not None and d.seeds == (0, 1, 2, 3) and d.n == 4
    assert d.mean == pytest.approx(1.75)  # (2.5 + 0.75 + 0.25 + 3.5) / 4
    assert (d.low, d.high) == (pytest.approx(reference.low), pytest.approx(reference.high))
    assert d.excludes_zero == (reference.low > 0 or reference.high < 0)


def test_paired_difference_without_enough_seeds() -> None:
    one = paired_difference({0: 3.0}, {0: 1.0})
    assert one is not None and one.mean == 2.0 and one.low is None and not one.excludes_zero
    assert paired_difference({0: 3.0}, {1: 1.0}) is None
    diverged = paired_difference({0: math.inf, 1: 2.0}, {0: 1.0, 1: 1.0})
    assert diverged is not None and diverged.mean == math.inf and diverged.low is None
    assert paired_difference({0: 1.0}, {0: math.inf}).mean == -math.inf  # only y diverged: x is better
    assert math.isnan(paired_difference({0: math.inf}, {0: math.inf}).mean)  # both: no order
    assert math.isnan(paired_difference({0: math.inf, 1: 1.0}, {0: 1.0, 1: math.inf}).mean)  # both ways
