"""Projection bases: the sign convention that makes runs independent of the SVD routine."""

import pytest
import torch

import fira_optim.projection as projection
from fira_optim import FiraAdamW
from fira_optim.projection import compute_basis

SHAPES = [(24, 40), (40, 24)]  # a left and a right projection


def _grads(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        row = []
        for m, n in SHAPES:
            a, b = torch.randn(m, 3, generator=g), torch.randn(3, n, generator=g)
            row.append(a @ b * (1 + 0.1 * k) + 0.3 * torch.randn(m, n, generator=g))
        out.append(row)
    return out


def _run(align_signs, flip_every_other_refresh, monkeypatch):
    """Train two matrices across 4 refreshes; optionally negate half of the singular vectors
    that every second SVD returns (what a different LAPACK / cuSOLVER / precision may do)."""
    calls = {"n": 0}
    svd = torch.linalg.svd

    def flipping_svd(a, full_matrices=True):
        u, s, vh = svd(a, full_matrices=full_matrices)
        calls["n"] += 1
        refresh_round = (calls["n"] - 1) // len(SHAPES)  # one SVD per matrix per refresh
        if flip_every_other_refresh and refresh_round % 2 == 1:
            signs = torch.ones(s.shape[-1], dtype=u.dtype)
            signs[::2] = -1
            u, vh = u * signs, vh * signs[:, None]
        return u, s, vh

    monkeypatch.setattr(projection.torch.linalg, "svd", flipping_svd)
    init = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=init)) for s in SHAPES]
    opt = FiraAdamW([{"params": params, "rank": 4}], lr=0.01, update_proj_gap=3,
                    align_signs=align_signs)
    for row in _grads(13):
        for p, g in zip(params, row):
            p.grad = g
        opt.step()
    assert calls["n"] >= 8  # every matrix refreshed at steps 0, 3, 6, 9, 12
    return [p.detach().clone() for p in params]


def test_aligned_run_does_not_depend_on_the_svd_signs(monkeypatch):
    plain = _run(True, False, monkeypatch)
    flipped = _run(True, True, monkeypatch)
    for a, b in zip(plain, flipped):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_raw_signs_change_the_run_when_the_svd_flips(monkeypatch):
    # The released behaviour: the carried-over first moment is reversed along flipped vectors.
    plain = _run(False, False, monkeypatch)
    flipped = _run(False, True, monkeypatch)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, flipped)) > 1e-4


@pytest.mark.parametrize("side", ["left", "right"])
def test_aligned_basis_points_along_the_previous_one(side):
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(30, 20, generator=g)
    previous = compute_basis(grad, 5, side, "svd")
    flipped = -previous
    nudged = grad + 1e-3 * torch.randn(30, 20, generator=g)
    aligned = compute_basis(nudged, 5, side, "svd", previous=flipped)
    assert bool(((aligned * flipped).sum(0) > 0).all())
    raw = compute_basis(nudged, 5, side, "svd", previous=flipped, align_signs=False)
    torch.testing.assert_close(aligned.abs(), raw.abs())


def test_align_signs_must_be_a_bool():
    with pytest.raises(ValueError, match="align_signs"):
        FiraAdamW([torch.nn.Parameter(torch.zeros(4, 4))], align_signs="yes")


@pytest.mark.parametrize("shape", [(6, 15), (15, 6), (9, 9)])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_wide_gradient_is_decomposed_as_its_transpose_with_the_same_basis(shape, side, monkeypatch):
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    plain = projection.svd_basis(grad, 4, side)
    inputs = []
    svd = torch.linalg.svd
    monkeypatch.setattr(projection.torch.linalg, "svd", lambda a, **kw: inputs.append(tuple(a.shape)) or svd(a, **kw))
    tall = projection.svd_basis(grad, 4, side, transpose_wide=True)
    assert inputs == [(max(shape), min(shape))] if shape[0] < shape[1] else inputs == [shape]
    signs = torch.sign(torch.diagonal(plain.T @ tall))
    torch.testing.assert_close(tall * signs, plain, rtol=0, atol=1e-10)
    assert tall.is_contiguous() and tall.shape == plain.shape


@pytest.mark.parametrize("shape", [(5, 9), (128, 4), (300, 7), (256, 3)])
@pytest.mark.parametrize("dim", [0, 1])
def test_block_norms_equal_the_plain_reduction(shape, dim):
    """sq_norms sums squared blocks of rows down the columns (dim 0): the same numbers as
    vector_norm, for row counts below, at and across the block size."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    expected = torch.linalg.vector_norm(t, dim=dim, keepdim=True)
    torch.testing.assert_close(projection.sq_norms(t, dim), expected.square(), rtol=1e-12, atol=0)
    torch.testing.assert_close(projection.norms(t, dim), expected, rtol=1e-12, atol=0)
    assert projection.sq_norms(t, dim).shape == expected.shape
