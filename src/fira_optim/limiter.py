r"""Stabilisers for the scaled residual :math:`S_t = \phi_t(R_t) (G_t - P_t R_t)`.

Each returns a 0-d factor ``f`` (a tensor, so no host synchronisation) that multiplies
:math:`S_t`; the caller stores :math:`f \|S_t\|` as the history for the next step.

``"growth"`` -- the norm-growth limiter of the paper (Eqn. 12, Algorithm 1):

.. math::
    S_t \leftarrow S_t \cdot \gamma / \max\left(\frac{\|S_t\|}{\|S_{t-1}\| + \epsilon}, \gamma\right)

Nothing is limited while there is no history (:math:`\|S_{t-1}\| = 0`: the first step, or
after all-zero residuals), as in the released code; otherwise the limiter would shrink the
residual to :math:`\gamma\epsilon` and keep it there forever.

Ablations of the paper (Section 5.4, Appendix F):
``"none"`` (Fira-w.o.-limiter), ``"clip"`` (absolute norm clipping,
:math:`\|S_t\| \le c`), ``"shrink"`` (gradient shrink,
:math:`\|S_t\| \leftarrow \mu\|S_t\| + (1-\mu)\|S_{t-1}\|`) and ``"tensorwise"``
(tensor-wise scaling, :math:`\|S_t\| \leftarrow \mu\|S_t\|`).
"""

from __future__ import annotations

import torch

LIMITERS = ("growth", "none", "clip", "shrink", "tensorwise")


def limiter_factor(
    kind: str,
    norm: torch.Tensor,
    prev_norm: torch.Tensor,
    *,
    gamma: float,
    eps: float,
    clip_norm: float,
    mu: float,
) -> torch.Tensor:
    """Factor applied to :math:`S_t` given its norm and the previous (post-limit) norm."""
    one = torch.ones_like(norm)
    if kind == "growth":
        ratio = norm / (prev_norm + eps)
        limited = gamma / torch.clamp(ratio, min=gamma)
        return torch.where(prev_norm > 0, limited, one)
    if kind == "none":
        return one
    if kind == "clip":
        return torch.clamp(clip_norm / (norm + 1e-6), max=1.0)
    if kind == "shrink":
        target = mu * norm + (1.0 - mu) * prev_norm
        return torch.where((prev_norm > 0) & (norm > 0), target / norm.clamp(min=eps), one)
    if kind == "tensorwise":
        return one * mu
    raise ValueError(f"Invalid limiter: {kind!r}; expected one of {LIMITERS}")
