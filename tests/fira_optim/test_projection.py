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
    aligned = compute_basis(nudged, 5, side, "svd", previous=flipped, align_signs=True)
    assert bool(((aligned * flipped).sum(0) > 0).all())
    raw = compute_basis(nudged, 5, side, "svd", previous=flipped)  # the default: raw signs
    torch.testing.assert_close(aligned.abs(), raw.abs())
    assert FiraAdamW([torch.nn.Parameter(torch.zeros(4, 4))]).defaults["align_signs"] is False


def test_align_signs_must_be_a_bool():
    with pytest.raises(ValueError, match="align_signs"):
        FiraAdamW([torch.nn.Parameter(torch.zeros(4, 4))], align_signs="yes")


@pytest.mark.parametrize("shape", [(6, 15), (15, 6), (9, 9), (12, 10), (10, 12)])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_fast_svd_route_gives_the_plain_basis(shape, side, dtype, monkeypatch):
    """fast_route decomposes the tall orientation, through the R factor of its QR when the
    small side is wanted and the matrix is at least 1.5 times taller than wide: the same
    singular vectors as the plain SVD up to sign, to round-off."""
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    plain = projection.svd_basis(grad, 4, side)
    inputs = []
    svd = torch.linalg.svd
    monkeypatch.setattr(projection.torch.linalg, "svd", lambda a, **kw: inputs.append(tuple(a.shape)) or svd(a, **kw))
    fast = projection.svd_basis(grad, 4, side, fast_route=True)
    small, large = min(shape), max(shape)
    wants_small_side = (side == "left") == (shape[0] < shape[1])
    qr_first = wants_small_side and large >= projection.QR_FIRST_RATIO * small
    assert inputs == [(small, small) if qr_first else (large, small)]
    signs = torch.sign(torch.diagonal(plain.T @ fast))
    torch.testing.assert_close(fast * signs, plain, rtol=0, atol=1e-10 if dtype == torch.float64 else 1e-4)
    assert fast.is_contiguous() and fast.shape == plain.shape and fast.dtype == dtype


def test_the_fast_svd_route_retries_in_float64(monkeypatch):
    grad = torch.randn(20, 6, generator=torch.Generator().manual_seed(1))
    svd = torch.linalg.svd

    def fail_in_fp32(a, **kw):
        if a.dtype == torch.float32:
            raise torch.linalg.LinAlgError("simulated")
        return svd(a, **kw)

    monkeypatch.setattr(projection.torch.linalg, "svd", fail_in_fp32)
    with pytest.warns(RuntimeWarning, match="retrying in float64"):
        fast = projection.svd_basis(grad, 3, "right", fast_route=True)
    exact = svd(grad.double(), full_matrices=False)[2][:3].T
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast.double().abs(), exact.abs(), rtol=0, atol=1e-6)


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
