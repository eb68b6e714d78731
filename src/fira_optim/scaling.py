r"""Stage 4 of Algorithm 1, norm-based scaling: the low-rank optimizer's own scaling factor.

The scaling factor of the paper (Eqn. 10, and per column Eqn. 11 / Algorithm 1) is

.. math::
    \phi_i = \frac{\|N_{:,i}\|}{\|R_{:,i}\| + \epsilon}

taken along the dimension that is not projected (columns for a left projection, rows for a
right one). ``"matrix"`` uses one factor for the whole matrix (Fira-matrix);
``"none"`` uses :math:`\phi = 1` (Fira-w.o.-scaling, and GaLore-add).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .options import SCALINGS, Scaling

__all__ = ["SCALINGS", "scaling_factor", "scaling_factors"]

#: Column (``dim=0``) or row (``dim=1``) norms of a matrix, keepdim.
ColumnNorms = Callable[[torch.Tensor, int], torch.Tensor]
#: Completes, in place, a sum over the rows of a row-sharded matrix (FSDP2); None in one process.
RowSum = Optional[Callable[[torch.Tensor], torch.Tensor]]


def exact_norms(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.linalg.vector_norm`` along ``dim``, keepdim."""
    return torch.linalg.vector_norm(t, dim=dim, keepdim=True)


def scaling_factors(
    directions: list[torch.Tensor],
    lows: list[torch.Tensor],
    low_norms: list[torch.Tensor],
    dims: list[int],
    level: Scaling,
    eps: float,
    *,
    column_norms: ColumnNorms = exact_norms,
    from_column_norms: bool = False,
    row_sum: RowSum = None,
    right: Optional[list[bool]] = None,
) -> list[torch.Tensor]:
    r""":math:`\phi` of each matrix, shaped to broadcast against its ``m x n`` gradient:
    ``(1, n)`` for ``dim=0``, ``(m, 1)`` for ``dim=1``, 0-d for ``"matrix"`` and ``"none"``.

    ``low_norms`` are the ``lows``' column norms along ``dims`` (keepdim), ``column_norms``
    the function that took them, used for the directions too. A matrix-level factor takes
    :math:`\|R\|` as the norm of ``low_norms`` (``from_column_norms``: one pass less) or of ``R``.
    Under FSDP2 (``row_sum``), a right projection's ``N`` and ``R`` are row blocks
    (``right[i]``): their matrix-level norms are completed across the shards.
    """
    if level is Scaling.COLUMN:
        dn = [column_norms(d, dim) for d, dim in zip(directions, dims)]
        return torch._foreach_div(dn, torch._foreach_add(low_norms, eps))
    if level is Scaling.NONE:
        return [torch.ones((), dtype=d.dtype, device=d.device) for d in directions]
    dn = torch._foreach_norm(directions)
    ln = torch._foreach_norm(low_norms if from_column_norms else lows)
    phis = list(torch._foreach_div(dn, torch._foreach_add(ln, eps)))
    sharded = [i for i in range(len(directions)) if row_sum is not None and right and right[i]]
    if sharded:
        squares = torch.stack([t.square().sum() for i in sharded for t in (directions[i], lows[i])])
        whole = row_sum(squares).sqrt()
        for k, i in enumerate(sharded):
            phis[i] = whole[2 * k] / (whole[2 * k + 1] + eps)
    return phis


def scaling_factor(direction: torch.Tensor, low: torch.Tensor, dim: int, level: str,
                   eps: float) -> torch.Tensor:
    """:func:`scaling_factors` of one matrix (exact norms)."""
    level = Scaling.parse("scaling", level)
    return scaling_factors([direction], [low], [exact_norms(low, dim)], [dim], level, eps)[0]
