r"""Stage 6 of Algorithm 1: stabilisers for the scaled residual :math:`S_t = \phi_t(R_t) (G_t - P_t R_t)`.

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

from .options import LIMITERS, Hyper, Limiter

__all__ = ["LIMITERS", "limit", "limiter_factor"]


def limiter_factor(
    kind: Limiter | str,
    norm: torch.Tensor,
    prev_norm: torch.Tensor,
    *,
    gamma: float,
    eps: float,
    clip_norm: float,
    mu: float,
) -> torch.Tensor:
    """Factor applied to :math:`S_t` given its norm and the previous (post-limit) norm."""
    if not isinstance(kind, Limiter):
        kind = Limiter.parse("limiter", kind)
    one = torch.ones_like(norm)
    if kind is Limiter.GROWTH:
        ratio = norm / (prev_norm + eps)
        limited = gamma / torch.clamp(ratio, min=gamma)
        return torch.where(prev_norm > 0, limited, one)
    if kind is Limiter.NONE:
        return one
    if kind is Limiter.CLIP:
        return torch.clamp(clip_norm / (norm + 1e-6), max=1.0)
    if kind is Limiter.SHRINK:
        target = mu * norm + (1.0 - mu) * prev_norm
        return torch.where((prev_norm > 0) & (norm > 0), target / norm.clamp(min=eps), one)
    return one * mu  # Limiter.TENSORWISE


def limit(norms: torch.Tensor, prev_norms: list[torch.Tensor], hp: Hyper) -> list[torch.Tensor]:
    r"""The limiter factor of each matrix from the stack of their :math:`\|S_t\|`; each
    ``prev_norm`` (the history, :math:`f \|S_t\|`) is updated in place."""
    factors = limiter_factor(hp.limiter, norms, torch.stack(prev_norms), gamma=hp.gamma,
                             eps=hp.residual_eps, clip_norm=hp.clip_norm, mu=hp.mu)
    torch._foreach_copy_(prev_norms, list((norms * factors).unbind()))
    return list(factors.unbind())
