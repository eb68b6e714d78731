"""Stage 5: the residual norm from column norms equals the norm of the explicit residual."""

import pytest
import torch

from fira_optim import FiraAdamW
from fira_optim.options import Hyper
from fira_optim.projection import LEFT, RIGHT, project, reduce_dim, sq_norms, svd_basis
from fira_optim.residual import explicit_residuals, residual_norms_from_columns
from fira_optim.scaling import exact_norms


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
    implicit = residual_norms_from_columns([sq_norms(g, d) for g, d in zip(grads, dims)],
                                           [exact_norms(low, d) for low, d in zip(lows, dims)],
                                           phis, sides, hp)
    torch.testing.assert_close(implicit, explicit, rtol=1e-12, atol=0)
    assert all(s.shape == g.shape for s, g in zip(scaled, grads))
