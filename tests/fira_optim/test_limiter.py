"""The stabilisers of the scaled residual, one formula each (paper Eqn. 12 and Section 5.4)."""

import pytest
import torch

from fira_optim.limiter import LIMITERS, limiter_factor

KW = dict(gamma=1.01, eps=1e-8, clip_norm=1.0, mu=0.1)


def _factor(kind, norm, prev, **overrides):
    return float(limiter_factor(kind, torch.tensor(norm, dtype=torch.float64),
                                torch.tensor(prev, dtype=torch.float64), **{**KW, **overrides}))


def test_growth_limits_the_norm_to_gamma_times_the_previous():
    # ||S_t|| = 10, ||S_{t-1}|| = 2: the ratio 5 > gamma, so S_t is scaled to gamma * (2 + eps).
    f = _factor("growth", 10.0, 2.0)
    assert f * 10.0 == pytest.approx(1.01 * (2.0 + 1e-8), rel=1e-12)


def test_growth_leaves_slow_growth_alone():
    assert _factor("growth", 2.0, 2.0) == 1.0
    assert _factor("growth", 2.0 * 1.005, 2.0) == 1.0
    assert _factor("growth", 0.5, 2.0) == 1.0  # shrinking is never limited


@pytest.mark.parametrize("norm", [0.0, 1e-3, 1e6])
def test_growth_skips_without_history(norm):
    # Previous norm 0 (first step, or after a zero residual): no limit, whatever the norm.
    assert _factor("growth", norm, 0.0) == 1.0


def test_none_is_identity():
    assert _factor("none", 1e6, 1e-6) == 1.0


def test_clip_caps_the_absolute_norm():
    assert _factor("clip", 0.5, 3.0) == 1.0
    assert 4.0 * _factor("clip", 4.0, 3.0) == pytest.approx(1.0, rel=1e-6)
    assert 8.0 * _factor("clip", 8.0, 0.0, clip_norm=2.0) == pytest.approx(2.0, rel=1e-6)


def test_shrink_is_a_moving_average_of_norms():
    # |S_t| <- mu |S_t| + (1 - mu) |S_{t-1}|
    assert 10.0 * _factor("shrink", 10.0, 2.0) == pytest.approx(0.1 * 10 + 0.9 * 2, rel=1e-12)
    assert _factor("shrink", 10.0, 0.0) == 1.0  # no history
    assert _factor("shrink", 0.0, 2.0) == 1.0  # nothing to scale


def test_tensorwise_scales_by_mu():
    assert _factor("tensorwise", 10.0, 2.0, mu=0.25) == 0.25


def test_factor_is_a_tensor_on_the_norm_device():
    # No host synchronisation: the factor stays a 0-d tensor.
    for kind in LIMITERS:
        f = limiter_factor(kind, torch.tensor(3.0), torch.tensor(1.0), **KW)
        assert isinstance(f, torch.Tensor) and f.dim() == 0


def test_unknown_limiter_raises():
    with pytest.raises(ValueError, match="limiter.*'max'"):
        limiter_factor("max", torch.tensor(1.0), torch.tensor(1.0), **KW)
