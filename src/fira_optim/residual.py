r"""Stage 5 of Algorithm 1: the scaled residual :math:`S_t = \phi \odot (G_t - P_t R_t)` and its
norm :math:`\|S_t\|`, which the limiter compares with the previous step's.

Two strategies compute the same norm. *Explicit* (the reference path) forms :math:`S_t` as an
``m x n`` tensor, line by line as in the paper. *From column norms* (the fast paths) never
forms it: for an orthonormal basis,

.. math::
    \|\phi \odot (G - k' P R)\|^2 = \sum_i \phi_i^2 \left(\|g_i\|^2 - k \|r_i\|^2\right),
    \qquad k = 2k' - k'^2

(:math:`k' = 1`, or :math:`\alpha` for the released residual :math:`G - \alpha P R`), from the
column norms of ``G`` and ``R`` that the step has anyway.

The subtraction loses precision as the residual shrinks: about
:math:`\log_2(\|\phi \odot G\|^2 / \|S\|^2)` of the dtype's bits (a gradient of rank at most
``r``, such as a batch of fewer tokens than the rank, lies almost wholly in the subspace). Where
fewer than :data:`KEPT_BITS` would be left (:func:`cancelled`: in float32 where
:math:`\|S\| < 0.088 \|\phi \odot G\|`), the fast paths form that matrix's :math:`S`
explicitly, so that they give the reference's norm to rounding and the limiter the same history.

Variants: FRUGAL takes :math:`\mathrm{sign}(G - P R)` (no scaling, explicit only);
Fira-only-scaling takes :math:`\phi \odot G`.
"""

from __future__ import annotations

import torch

from .options import Hyper, Residual
from .projection import RIGHT, project_back
from .scaling import RowSum


def explicit_residuals(grads, lows, bases, sides, phis, hp: Hyper,
                       row_sum: RowSum = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(norms, S)``: each matrix's scaled residual as a tensor and the stack of their norms.

    Under FSDP2 each ``G`` is a row block and ``||S||^2`` sums over every shard's rows."""
    scaled, norms = [], []
    for i, (grad, low, basis, side) in enumerate(zip(grads, lows, bases, sides)):
        if hp.only_scaling and hp.residual is not Residual.SIGN:  # phi (.) G: no residual to form
            s = phis[i] * grad
        else:
            # S_t = G - P R (the released code subtracts alpha * P R), formed in P R's buffer:
            # one m x n temporary, not one per operation (the same bits as out of place)
            s = project_back(low, basis, side)
            if hp.released:
                s.mul_(hp.alpha)
            torch.sub(grad, s, out=s)
            if hp.residual is Residual.SIGN:  # FRUGAL: signSGD outside the subspace, no scaling
                s.sign_()
            else:
                s.mul_(phis[i])
        norm = torch.linalg.vector_norm(s)
        if row_sum is not None:
            norm = row_sum(norm.square()).sqrt()
        scaled.append(s)
        norms.append(norm)
    return torch.stack(norms), scaled


def residual_norms_from_columns(grad_sqs, low_norms, phis, sides, hp: Hyper,
                                row_sum: RowSum = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(norms, wholes)``: :math:`\|S\|` and :math:`\|\phi \odot G\|` of each matrix from
    :math:`\|g_i\|^2` (``grad_sqs``, this rank's rows) and :math:`\|r_i\|` (``low_norms``),
    without forming ``S``. ``grad_sqs`` are consumed. :func:`cancelled` tells from the two
    which norms lost too many bits.

    Under FSDP2 (``row_sum``) a left projection's :math:`\|g_i\|^2` sums over every shard's rows
    (one collective for all of them) and a right one's squared norms over the shards."""
    outside_sq = list(grad_sqs)  # becomes ||s_i||^2 in place
    if row_sum is not None:
        _row_sum_many([q for q, side in zip(outside_sq, sides) if side != RIGHT], row_sum)
    phi_sq = torch._foreach_mul(phis, phis)
    wholes = torch._foreach_mul(phi_sq, outside_sq)  # phi_i^2 ||g_i||^2
    if not hp.only_scaling:
        low_sq = torch._foreach_mul(low_norms, low_norms)
        torch._foreach_sub_(outside_sq, low_sq, alpha=hp.residual_coef)
        torch._foreach_clamp_min_(outside_sq, 0.0)
    # ||phi (.) S|| = sqrt(sum_i phi_i^2 ||s_i||^2), one norm per matrix.
    terms = torch._foreach_mul(phi_sq, outside_sq)
    torch._foreach_sqrt_(terms)
    torch._foreach_sqrt_(wholes)
    norms = torch.stack([*torch._foreach_norm(terms), *torch._foreach_norm(wholes)])
    if row_sum is not None and RIGHT in sides:
        # A right matrix's squared norms have one term per row: sum the shards' parts.
        right = torch.tensor([side == RIGHT for side in sides] * 2, device=norms.device)
        squares = norms.square()
        squares[right] = row_sum(squares[right])
        norms = squares.sqrt()
    return norms[: len(sides)], norms[len(sides):]


#: The bits of the working dtype that :func:`residual_norms_from_columns`'s subtraction must keep
#: (a relative error of about ``2**-16`` in :math:`\|S\|^2`); below, :math:`S` is formed.
KEPT_BITS = 16


def cancelled(norms: torch.Tensor, wholes: torch.Tensor) -> list[int]:
    r"""The matrices whose :math:`\|S\|` from column norms kept fewer than :data:`KEPT_BITS`
    bits: :math:`\|S\|^2 < 2^{16} \epsilon_{\text{dtype}} \|\phi \odot G\|^2`. One host sync."""
    floor = 2.0**KEPT_BITS * torch.finfo(norms.dtype).eps
    return (norms.square() < floor * wholes.square()).nonzero().flatten().tolist()


def _row_sum_many(tensors: list[torch.Tensor], row_sum) -> None:
    """``row_sum`` applied to each of ``tensors`` in place, in one collective."""
    if not tensors:
        return
    flat = row_sum(torch.cat([t.reshape(-1) for t in tensors]))
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
