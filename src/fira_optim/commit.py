r"""Stage 7 of Algorithm 1: project back, complete the full-rank update, and apply it.

.. math::
    W \leftarrow (1 - \eta\lambda) W - \eta\,\alpha \left(P N + f\,S\right)

(``arithmetic="paper"``; weight decay decoupled as in ``torch.optim.AdamW``), or the released
``fira`` 1.0.2 arithmetic, where the scaled residual is not multiplied by :math:`\alpha`, the
bias correction sits in the step size :math:`\eta_t = \eta \sqrt{1-\beta_2^t}/(1-\beta_1^t)`
and the weight decay comes after the update:

.. math::
    W \leftarrow W - \eta_t \left(\alpha P N' + f\,S\right), \qquad W \leftarrow W - \eta\lambda W

GaLore adds no residual; Fira-only-scaling adds :math:`\alpha f \phi \odot G` alone.

Two strategies. :func:`commit_explicit` (the reference) forms the update as an ``m x n``
tensor. :func:`commit_fused` never does: with :math:`c = f \phi` and
:math:`c \odot (G - P R) = c \odot G - P (R \odot c)`, the update is one GEMM of
:math:`X = N - R \odot c` into the parameter and one ``addcmul_`` of :math:`c \odot G`.
"""

from __future__ import annotations

import torch

from .options import Hyper, Residual
from .projection import LEFT, project_back


def commit_explicit(param, basis, side, direction, scaled, factor, step: int, hp: Hyper) -> None:
    """One matrix, every term explicit. ``scaled``: :math:`\\phi \\odot S` before the limiter
    (None for GaLore), consumed (scaled in place). ``param`` is in the working dtype (a copy of
    a low-precision parameter, which the optimizer rounds into it once:
    :meth:`fira_optim.Fira._update`)."""
    # In place on P N and on ``scaled`` (which is the caller's to consume): at most two m x n
    # temporaries, with the same bits as the terms formed one by one.
    if hp.residual is Residual.DROP:  # GaLore
        update = project_back(direction, basis, side).mul_(hp.alpha)
    else:
        scaled.mul_(factor)
        if hp.only_scaling:
            update = scaled.mul_(hp.alpha)
        elif hp.released:
            update = project_back(direction, basis, side).mul_(hp.alpha).add_(scaled)
        else:
            update = project_back(direction, basis, side).add_(scaled).mul_(hp.alpha)
    if hp.weight_decay != 0 and not hp.released:
        param.mul_(1.0 - hp.lr * hp.weight_decay)
    param.sub_(update, alpha=hp.step_size(step))
    if hp.weight_decay != 0 and hp.released:
        # fira 1.0.2 decays after the update with the un-corrected lr: p -= lr * wd * p.
        param.add_(param, alpha=-hp.lr * hp.weight_decay)


def commit_fused(params, grads, bases, sides, directions, lows, phis, factors, step: int,
                 hp: Hyper) -> None:
    """Many matrices of one dtype: :math:`W \\leftarrow W - \\eta_t(\\alpha P X + c \\odot G)`
    (right projections: :math:`X Q^\\top`). ``phis``/``factors`` None: GaLore. The
    ``directions`` become the ``X`` in place."""
    cs = None
    xs = None if hp.only_scaling else directions
    if phis is not None:
        cs = torch._foreach_mul(phis, factors)  # c = f * phi: (1, n), (m, 1) or 0-d each
        if not hp.only_scaling:
            # P N - c (.) (P R) == P (N - R (.) c); released: alpha P N' - c (.) (alpha P R).
            torch._foreach_addcmul_(directions, lows, cs, value=-1.0)
    add_update(params, grads, bases, sides, xs, cs, step, hp)


def add_update(params, grads, bases, sides, xs, cs, step: int, hp: Hyper) -> None:
    r""":math:`W \leftarrow W - \eta_t\,(\alpha\, P X + c \odot G)` with decoupled weight decay.

    ``xs``: the low-rank :math:`X` of each matrix (None: Fira-only-scaling has no low-rank
    term); ``cs``: the scale of :math:`G`'s columns or rows (None: GaLore adds no residual).
    """
    step_size = hp.step_size(step)
    inside_coef = -step_size * hp.alpha
    outside_coef = -step_size if hp.released and not hp.only_scaling else inside_coef
    if hp.weight_decay != 0 and not hp.released:
        torch._foreach_mul_(params, 1.0 - hp.lr * hp.weight_decay)
    if xs is not None and cs is not None and params[0].device.type == "cpu":
        # On the CPU, W's second update right after its first, while W is still in cache; on a
        # GPU one multi-tensor launch for all the c (.) G beats one launch per matrix.
        for p, grad, basis, x, side, c in zip(params, grads, bases, xs, sides, cs):
            _addmm(p, basis, x, side, inside_coef)
            p.addcmul_(grad, c, value=outside_coef)
    else:
        if xs is not None:
            for p, basis, x, side in zip(params, bases, xs, sides):
                _addmm(p, basis, x, side, inside_coef)
        if cs is not None:
            torch._foreach_addcmul_(params, grads, cs, value=outside_coef)
    if hp.weight_decay != 0 and hp.released:
        torch._foreach_add_(params, params, alpha=-hp.lr * hp.weight_decay)


def _addmm(param: torch.Tensor, basis: torch.Tensor, low: torch.Tensor, side: str, alpha: float) -> None:
    """``param += alpha * (P low)`` (left) or ``alpha * (low Q^T)`` (right), in place."""
    if side == LEFT:
        param.addmm_(basis, low, alpha=alpha)
    else:
        param.addmm_(low, basis.T, alpha=alpha)
