r"""One Fira update of one projected matrix, given its low-rank gradient: two paths.

Both paths start from the same inputs -- the gradient ``G`` (``m x n``), the basis, the
low-rank gradient ``R`` and the per-parameter state -- and apply

.. math::
    W \leftarrow W - \eta\,\alpha \left(P N + \mathrm{limit}(\phi \odot (G - P R))\right)

(``arithmetic="paper"``, Algorithm 1) or the released ``fira`` 1.0.2 arithmetic

.. math::
    W \leftarrow W - \eta_t \left(\alpha P N' + \mathrm{limit}(\phi' \odot (G - \alpha P R))\right),
    \quad \eta_t = \eta \sqrt{1-\beta_2^t} / (1-\beta_1^t)

where :math:`N'` and :math:`\phi'` lack the bias correction and the weight decay comes after
the update.

:func:`apply_reference` forms every ``m x n`` term explicitly, line by line as in the
paper. :func:`apply_fast` never materialises the residual: for an orthonormal basis,
with :math:`c = f\phi` (``f`` the limiter factor),

.. math::
    c \odot (G - P R) = c \odot G - P (R \odot c), \qquad
    \|\phi \odot (G - P R)\|^2 = \sum_i \phi_i^2 (\|g_i\|^2 - \|r_i\|^2)

so the update is one ``addmm_`` (``P (N - R \odot c)``) and one ``addcmul_`` (``c \odot G``)
into the parameter. It is tested against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .limiter import limiter_factor
from .projection import LEFT, project_back, reduce_dim
from .scaling import scaling_factor
from .subspace import adam_bias_correction, base_direction

#: The epsilon that ``fira`` 1.0.2 hard-codes in the scaling factor and the limiter.
RELEASED_EPS = 1e-8


@dataclass(frozen=True)
class Hyper:
    """The hyper-parameters one update needs, read from a param group."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    alpha: float
    gamma: float
    base: str
    scaling: str
    limiter: str
    residual: str
    only_scaling: bool
    arithmetic: str
    correct_bias: bool
    clip_norm: float
    mu: float

    @classmethod
    def from_group(cls, group: dict) -> "Hyper":
        return cls(**{name: group[name] for name in cls.__dataclass_fields__})

    @property
    def released(self) -> bool:
        return self.arithmetic == "released"

    @property
    def residual_eps(self) -> float:
        # Algorithm 1 uses Adam's epsilon in the scaling factor and the limiter.
        return RELEASED_EPS if self.released else self.eps

    def step_size(self, step: int) -> float:
        """Learning rate multiplying the whole update (bias correction folded in if released)."""
        if self.released and self.correct_bias and self.base == "adam":
            beta1, beta2 = self.betas
            return self.lr * adam_bias_correction(step, beta1, beta2)
        return self.lr

    def direction_bias_corrected(self) -> bool:
        return self.correct_bias and not self.released


def _limit(hp: Hyper, norm: torch.Tensor, state: dict) -> torch.Tensor:
    factor = limiter_factor(
        hp.limiter,
        norm,
        state["prev_norm"],
        gamma=hp.gamma,
        eps=hp.residual_eps,
        clip_norm=hp.clip_norm,
        mu=hp.mu,
    )
    state["prev_norm"].copy_(norm * factor)
    return factor


def _decay_before(param: torch.Tensor, hp: Hyper) -> None:
    if hp.weight_decay != 0 and not hp.released:
        param.mul_(1.0 - hp.lr * hp.weight_decay)


def _decay_after(param: torch.Tensor, hp: Hyper) -> None:
    # fira 1.0.2 decays after the update with the un-corrected lr: p -= lr * wd * p.
    if hp.weight_decay != 0 and hp.released:
        param.add_(param, alpha=-hp.lr * hp.weight_decay)


def apply_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    low: torch.Tensor,
    basis: torch.Tensor,
    side: str,
    state: dict,
    step: int,
    hp: Hyper,
) -> None:
    """Readable path: every term of Algorithm 1 as an explicit tensor.

    ``grad``, ``low`` and ``basis`` are in the working dtype (at least fp32); ``param`` may be
    lower precision, in which case the update is formed in the working dtype and added once.
    ``step`` is the step count after the increment (1 on the first update).
    """
    work = param if param.dtype == grad.dtype else param.to(grad.dtype)
    dim = reduce_dim(side)
    direction = base_direction(
        hp.base, low, state, step, hp.betas, hp.eps, hp.direction_bias_corrected()
    )
    inside = project_back(direction, basis, side)  # P N
    if hp.residual == "drop":  # GaLore
        update = hp.alpha * inside
    else:
        # S_t = G - P R (the released code subtracts alpha * P R).
        back = project_back(low, basis, side)
        outside = grad - (hp.alpha * back if hp.released else back)
        if hp.residual == "sign":  # FRUGAL: signSGD outside the subspace, no scaling
            scaled = torch.sign(outside)
        else:
            phi = scaling_factor(direction, low, dim, hp.scaling, hp.residual_eps)
            scaled = phi * (grad if hp.only_scaling else outside)
        scaled = scaled * _limit(hp, torch.linalg.vector_norm(scaled), state)
        if hp.only_scaling:
            update = hp.alpha * scaled
        elif hp.released:
            update = hp.alpha * inside + scaled
        else:
            update = hp.alpha * (inside + scaled)
    _decay_before(work, hp)
    work.sub_(update, alpha=hp.step_size(step))
    _decay_after(work, hp)
    if work is not param:
        param.copy_(work)


def apply_fast(
    param: torch.Tensor,
    grad: torch.Tensor,
    low: torch.Tensor,
    basis: torch.Tensor,
    side: str,
    state: dict,
    step: int,
    hp: Hyper,
    low_norm: torch.Tensor | None = None,
) -> None:
    """Fused path: no ``m x n`` temporaries (``param``, ``grad`` share the working dtype).

    ``low_norm``: the per-column (``keepdim``) norms of ``low``, if the caller has them.
    """
    dim = reduce_dim(side)
    direction = base_direction(
        hp.base, low, state, step, hp.betas, hp.eps, hp.direction_bias_corrected()
    )
    step_size = hp.step_size(step)
    inside_coef = -step_size * hp.alpha
    # The released code does not multiply the scaled residual by alpha (ANCHORS.md).
    outside_coef = -step_size if hp.released and not hp.only_scaling else inside_coef
    _decay_before(param, hp)
    if hp.residual == "drop":
        _addmm(param, basis, direction, side, inside_coef)
        _decay_after(param, hp)
        return
    if low_norm is None:
        low_norm = torch.linalg.vector_norm(low, dim=dim, keepdim=True)
    phi = scaling_factor(direction, low, dim, hp.scaling, hp.residual_eps, low_norm)
    grad_sq = torch.linalg.vector_norm(grad, dim=dim, keepdim=True).square_()
    if hp.only_scaling:
        outside_sq = grad_sq
    else:
        low_sq = low_norm.square()
        # ||g_i - a P r_i||^2 = ||g_i||^2 - (2a - a^2) ||r_i||^2 for orthonormal P.
        coef = (2.0 * hp.alpha - hp.alpha**2) if hp.released else 1.0
        outside_sq = (grad_sq - coef * low_sq).clamp_(min=0)
    norm = (phi.square() * outside_sq).sum().sqrt()
    c = phi * _limit(hp, norm, state)  # (1, n), (m, 1) or 0-d
    if not hp.only_scaling:
        # P N - c (.) (P R) == P (N - R (.) c); released: alpha P N' - c (.) (alpha P R).
        _addmm(param, basis, direction - low * c, side, inside_coef)
    param.addcmul_(grad, c, value=outside_coef)
    _decay_after(param, hp)


def _addmm(param: torch.Tensor, basis: torch.Tensor, low: torch.Tensor, side: str, alpha: float) -> None:
    """``param += alpha * (P low)`` (left) or ``alpha * (low Q^T)`` (right), in place."""
    if side == LEFT:
        param.addmm_(basis, low, alpha=alpha)
    else:
        param.addmm_(low, basis.T, alpha=alpha)


def fast_path_supports(hp: Hyper, param: torch.Tensor, grad: torch.Tensor) -> bool:
    """The fused path covers everything but FRUGAL's sign residual and low-precision params."""
    return hp.residual != "sign" and param.dtype == grad.dtype
