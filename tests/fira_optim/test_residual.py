"""Stage 5: the residual norm from column norms equals the norm of the explicit residual."""

import pytest
import torch

from fira_optim import FiraAdamW
from fira_optim.options import Hyper
from fira_optim.projection import LEFT, RIGHT, project, reduce_dim, sq_norms, svd_basis
from fira_optim.residual import cancelled, explicit_residuals, residual_norms_from_columns
from fira_optim.scaling import exact_norms
from tests.fira_optim.common import low_rank_run


@pytest.mark.parametrize("options", [{}, {"arithmetic": "released", "alpha": 0.25},
                                     {"only_scaling": True}], ids=["paper", "released", "only-scaling"])
def test_column_norm_identity_equals_the_explicit_residual(options):
    hp = Hyper.from_group(FiraAdamW([torch.nn.Parameter(torch.zeros(2, 2))], **options).param_groups[0])
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(12, 20, generator=gen, dtype=torch.float64),
             torch.randn(20, 12, generator=gen, dtype=torch.float64)]
    sides = [LEFT, RIGHT]
    bases = [svd_basis(g, 4, side) for g, side in zip(grads, sides)]
    lows = [project(g, b, side) for g, b, side in zip(grads, bases, sides)]
    dims = [reduce_dim(side) for side in sides]
    phis = [torch.rand(exact_norms(g, d).shape, generator=gen, dtype=torch.float64)
            for g, d in zip(grads, dims)]
    explicit, scaled = explicit_residuals(grads, lows, bases, sides, phis, hp)
    implicit, wholes = residual_norms_from_columns([sq_norms(g, d) for g, d in zip(grads, dims)],
                                                   [exact_norms(low, d) for low, d in zip(lows, dims)],
                                                   phis, sides, hp)
    torch.testing.assert_close(implicit, explicit, rtol=1e-12, atol=0)
    assert all(s.shape == g.shape for s, g in zip(scaled, grads))
    torch.testing.assert_close(wholes, torch.stack([torch.linalg.vector_norm(phi * g) for phi, g in zip(phis, grads)]),
                               rtol=1e-12, atol=0)
    assert cancelled(implicit, wholes) == []  # a random G: most of it outside a rank-4 subspace


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_norms_whose_subtraction_kept_too_few_bits_are_found(dtype):
    eps = torch.finfo(dtype).eps
    wholes = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=dtype)
    # ||S||^2 / ||phi G||^2 at 4x and at a quarter of 2^16 eps (kept: about 18 and 14 bits)
    norms = torch.tensor([(4 * 2**16 * eps) ** 0.5, (2**16 * eps / 4) ** 0.5, 0.0, 0.0], dtype=dtype)
    assert cancelled(norms, wholes) == [1, 2]  # a zero gradient (0 of 0) is exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_gradient_inside_the_subspace_gets_the_reference_s_norm_on_the_fast_path(dtype):
    """At the refresh G lies in the subspace: ||S|| is round-off, and the next steps' limiter
    divides by it. The column-norm subtraction gave ~sqrt(eps) ||G|| there (470x the reference's
    limiter factor in float32, weights 84% of their movement apart after ten steps)."""
    weights, seen, history = low_rank_run("reference", dtype)
    fast_weights, fast_seen, fast_history = low_rank_run("fast", dtype)
    assert seen[0][0] < 1e-4 * seen[1][0]  # the first step's residual is round-off
    rtol = 1e-4 if dtype == torch.float32 else 1e-10
    for (norm, factor), (fast_norm, fast_factor) in zip(seen, fast_seen):
        assert fast_norm == pytest.approx(norm, rel=rtol) and fast_factor == pytest.approx(factor, rel=rtol)
    assert fast_history == pytest.approx(history, rel=rtol)
    torch.testing.assert_close(fast_weights, weights, rtol=rtol, atol=0)


@pytest.mark.parametrize("options", [{}, {"arithmetic": "released", "alpha": 0.25}, {"only_scaling": True},
                                     {"residual": "sign"}, {"residual": "drop"},
                                     {"residual": "sign", "only_scaling": True},
                                     {"residual": "sign", "arithmetic": "released", "alpha": 0.25}],
                         ids=["paper", "released", "only-scaling", "frugal", "galore", "frugal-only-scaling",
                              "frugal-released"])
@pytest.mark.parametrize("side", [LEFT, RIGHT])
def test_the_reference_terms_formed_in_place_have_the_bits_of_the_terms_one_by_one(options, side):
    """The reference path forms S and the update in two buffers, in place: the same float32
    bits as each term of Algorithm 1 (and the variants, and their combinations: FRUGAL's sign
    with only_scaling raised a TypeError once) formed as a new tensor."""
    from fira_optim.commit import commit_explicit
    from fira_optim.projection import project_back

    hp = Hyper.from_group(FiraAdamW([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.01, weight_decay=0.1,
                                    **options).param_groups[0])
    gen = torch.Generator().manual_seed(5)
    grad, weight = torch.randn(24, 40, generator=gen), torch.randn(24, 40, generator=gen)
    basis = svd_basis(grad, 4, side)
    low = project(grad, basis, side)
    phi = torch.rand(exact_norms(grad, reduce_dim(side)).shape, generator=gen)
    direction, factor = torch.randn(low.shape, generator=gen), torch.tensor(0.7)
    # FRUGAL's sign has no scaling factor: the pipeline passes none
    phis = None if options.get("residual") == "sign" else [phi]
    norms, (scaled,) = explicit_residuals([grad], [low], [basis], [side], phis, hp)
    # the terms one by one, as the paper writes them
    outside = grad - (hp.alpha * project_back(low, basis, side) if hp.released else project_back(low, basis, side))
    expected_s = (torch.sign(outside) if options.get("residual") == "sign"
                  else phi * (grad if hp.only_scaling else outside))
    assert torch.equal(scaled, expected_s)
    assert torch.equal(norms[0], torch.linalg.vector_norm(expected_s))
    inside = project_back(direction, basis, side)
    if options.get("residual") == "drop":
        update = hp.alpha * inside
    elif hp.only_scaling:
        update = hp.alpha * (expected_s * factor)
    elif hp.released:
        update = hp.alpha * inside + expected_s * factor
    else:
        update = hp.alpha * (inside + expected_s * factor)
    expected_w = weight.clone()
    if not hp.released:
        expected_w.mul_(1.0 - hp.lr * hp.weight_decay)
    expected_w.sub_(update, alpha=hp.step_size(3))
    if hp.released:
        expected_w.add_(expected_w, alpha=-hp.lr * hp.weight_decay)
    commit_explicit(weight, basis, side, direction, None if hp.residual.value == "drop" else scaled,
                    None if hp.residual.value == "drop" else factor, 3, hp)
    assert torch.equal(weight, expected_w)
