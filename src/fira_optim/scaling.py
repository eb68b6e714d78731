r"""Norm-based scaling: the low-rank optimizer's own scaling factor, applied outside the subspace.

The scaling factor of the paper (Eqn. 10, and per column Eqn. 11 / Algorithm 1) is

.. math::
    \phi_i = \frac{\|N_{:,i}\|}{\|R_{:,i}\| + \epsilon}

taken along the dimension that is not projected (columns for a left projection, rows for a
right one). ``"matrix"`` uses one factor for the whole matrix (Fira-matrix);
``"none"`` uses :math:`\phi = 1` (Fira-w.o.-scaling, and GaLore-add).
"""

from __future__ import annotations

import torch

SCALINGS = ("column", "matrix", "none")


def scaling_factor(
    direction: torch.Tensor,
    low: torch.Tensor,
    dim: int,
    level: str,
    eps: float,
    low_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return :math:`\\phi` shaped to broadcast against the full ``m x n`` gradient.

    ``dim`` is the reduction dimension of :func:`fira_optim.projection.reduce_dim`: the
    result has shape ``(1, n)`` for ``dim=0`` and ``(m, 1)`` for ``dim=1``; a 0-d tensor for
    ``"matrix"`` and ``"none"``.
    """
    if level == "column":
        return torch.linalg.vector_norm(direction, dim=dim, keepdim=True) / (
            torch.linalg.vector_norm(low, dim=dim, keepdim=True) + eps
        )
    if level == "matrix":
        return torch.linalg.vector_norm(direction) / (torch.linalg.vector_norm(low) + eps)
    if level == "none":
        return torch.ones((), dtype=low.dtype, device=low.device)
    raise ValueError(f"Invalid scaling: {level!r}; expected one of {SCALINGS}")
