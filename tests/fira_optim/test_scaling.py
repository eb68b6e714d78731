"""The norm-based scaling factor phi (paper Eqn. 10-11), checked against explicit loops."""

import pytest
import torch

from fira_optim.scaling import scaling_factor

EPS = 1e-8


def _pair(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64),
            torch.randn(shape, generator=g, dtype=torch.float64))


def test_column_scaling_for_a_left_projection():
    # R, N: r x n; one factor per column i: ||N[:, i]|| / (||R[:, i]|| + eps), shaped (1, n).
    direction, low = _pair((3, 7))
    phi = scaling_factor(direction, low, 0, "column", EPS)
    assert phi.shape == (1, 7)
    for i in range(7):
        expected = direction[:, i].norm() / (low[:, i].norm() + EPS)
        assert float(phi[0, i]) == pytest.approx(float(expected), rel=1e-14)


def test_row_scaling_for_a_right_projection():
    # R, N: m x r; one factor per row j, shaped (m, 1).
    direction, low = _pair((9, 3), seed=1)
    phi = scaling_factor(direction, low, 1, "column", EPS)
    assert phi.shape == (9, 1)
    for j in range(9):
        expected = direction[j].norm() / (low[j].norm() + EPS)
        assert float(phi[j, 0]) == pytest.approx(float(expected), rel=1e-14)


def test_matrix_scaling_is_one_factor():
    direction, low = _pair((3, 7), seed=2)
    phi = scaling_factor(direction, low, 0, "matrix", EPS)
    assert phi.dim() == 0
    assert float(phi) == pytest.approx(float(direction.norm() / (low.norm() + EPS)), rel=1e-14)


def test_no_scaling_is_one():
    direction, low = _pair((3, 7), seed=3)
    assert float(scaling_factor(direction, low, 0, "none", EPS)) == 1.0


def test_zero_columns_get_a_zero_factor_not_nan():
    direction, low = _pair((3, 7), seed=4)
    direction[:, 2] = 0
    low[:, 2] = 0
    phi = scaling_factor(direction, low, 0, "column", EPS)
    assert torch.isfinite(phi).all() and float(phi[0, 2]) == 0.0


def test_unknown_scaling_raises():
    direction, low = _pair((3, 7))
    with pytest.raises(ValueError, match="scaling.*'row'"):
        scaling_factor(direction, low, 0, "row", EPS)
