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
paper. :func:`apply_fast` (many matrices at once, ``foreach``) never materialises the residual: for an orthonormal basis,
with :math:`c = f\phi` (``f`` the limiter factor),

.. math::
    c \odot (G - P R) = c \odot G - P (R \odot c), \qquad
    \|\phi \odot (G - P R)\|^2 = \sum_i \phi_i^2 (\|g_i\|^2 - \|r_i\|^2)

so the update is one ``addmm_`` (``P (N - R \odot c)``) and one ``addcmul_`` (``c \odot G``)
into the parameter. It is tested against the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .limiter import limiter_factor
from .projection import LEFT, RIGHT, norms, project_back, reduce_dim, sq_norms
from .scaling import scaling_factor
from .subspace import adam_bias_correction, base_direction

#: The epsilon that ``fira`` 1.0.2 hard-codes in the scaling factor and the limiter.
RELEASED_EPS = 1e-8

#: Under FSDP2 each rank holds a row block of ``param`` and ``grad`` (and of ``low`` for a right
#: projection; a left ``R`` is whole). ``row_sum`` completes, in place, a sum that runs over the
#: rows of the matrix (an all-reduce over the shards: :mod:`fira_optim.distributed`); ``None``
#: in one process.
RowSum = Optional[Callable[[torch.Tensor], torch.Tensor]]


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
    row_sum: RowSum = None,
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
            if row_sum is not None and side == RIGHT and hp.scaling == "matrix":
                phi = _sharded_matrix_scaling([direction], [low], row_sum, hp)[0]
            else:
                phi = scaling_factor(direction, low, dim, hp.scaling, hp.residual_eps)
            scaled = phi * (grad if hp.only_scaling else outside)
        norm = torch.linalg.vector_norm(scaled)
        if row_sum is not None:  # ||S||^2 sums over every shard's rows
            norm = row_sum(norm.square()).sqrt()
        scaled = scaled * _limit(hp, norm, state)
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
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    lows: list[torch.Tensor],
    low_norms: list[torch.Tensor],
    bases: list[torch.Tensor],
    sides: list[str],
    states: list[dict],
    step: int,
    hp: Hyper,
    row_sum: RowSum = None,
    grad_sqs: Optional[list[torch.Tensor]] = None,
) -> None:
    """Multi-tensor fused path for matrices that share hyper-parameters and step count.

    No ``m x n`` temporaries: per matrix, one GEMM (``addmm_`` into the parameter) and one
    read of ``G`` for its column norms; Adam on the small ``r x n`` tensors is one pass of
    torch's fused Adam kernel where it exists (:func:`_fused_adam_direction`), everything
    else ``foreach`` arithmetic on them and on norm vectors. ``low_norms`` are the per-column (``keepdim``)
    norms of the ``lows``; ``grad_sqs``, if given, the squared per-column norms of the
    ``grads`` (this rank's rows), which are otherwise computed here; ``params`` and ``grads``
    share the working dtype.
    """
    dims = [reduce_dim(side) for side in sides]
    directions = _foreach_direction(lows, states, step, hp)
    if hp.residual == "drop":
        add_update(params, grads, bases, sides, directions, None, step, hp)
    else:
        phis = _foreach_scaling(directions, low_norms, dims, hp)
        if grad_sqs is None or any(q is None for q in grad_sqs):
            grad_sqs = [sq_norms(g, dim) for g, dim in zip(grads, dims)]
        outside_sq = list(grad_sqs)  # becomes ||s_i||^2 in place below
        if row_sum is not None:
            # Row blocks: a right matrix-level phi and a left ||g_i||^2 sum over all rows.
            right = [i for i, side in enumerate(sides) if side == RIGHT]
            if hp.scaling == "matrix" and right:
                whole = _sharded_matrix_scaling([directions[i] for i in right],
                                                [lows[i] for i in right], row_sum, hp)
                phis = list(phis)
                for i, phi in zip(right, whole):
                    phis[i] = phi
            _row_sum_many([q for q, side in zip(outside_sq, sides) if side == LEFT], row_sum)
        if not hp.only_scaling:
            # ||g_i - a P r_i||^2 = ||g_i||^2 - (2a - a^2) ||r_i||^2 for orthonormal P.
            coef = (2.0 * hp.alpha - hp.alpha**2) if hp.released else 1.0
            low_sq = torch._foreach_mul(low_norms, low_norms)
            torch._foreach_sub_(outside_sq, low_sq, alpha=coef)
            torch._foreach_clamp_min_(outside_sq, 0.0)
        # ||phi (.) S|| = sqrt(sum_i phi_i^2 ||s_i||^2), one norm per matrix.
        terms = torch._foreach_mul(torch._foreach_mul(phis, phis), outside_sq)
        torch._foreach_sqrt_(terms)
        norms = torch.stack(torch._foreach_norm(terms))
        if row_sum is not None and RIGHT in sides:
            # A right matrix's ||S||^2 has one term per row: sum the shards' parts.
            right = torch.tensor([side == RIGHT for side in sides], device=norms.device)
            squares = norms.square()
            part = squares[right]
            squares[right] = row_sum(part)
            norms = squares.sqrt()
        prev = [state["prev_norm"] for state in states]
        factors = _limit_many(hp, norms, prev)
        cs = torch._foreach_mul(phis, factors)  # c = f * phi: (1, n), (m, 1) or 0-d each
        if not hp.only_scaling:
            # P N - c (.) (P R) == P (N - R (.) c); released: alpha P N' - c (.) (alpha P R).
            torch._foreach_addcmul_(directions, lows, cs, value=-1.0)
        add_update(params, grads, bases, sides, None if hp.only_scaling else directions, cs, step, hp)


def add_update(params, grads, bases, sides, xs, cs, step: int, hp: Hyper) -> None:
    r"""The commit of a step, shared by :func:`apply_fast` and :mod:`fira_optim.compiled`:

    .. math:: W \leftarrow W - \eta_t\,(lpha\, P X + c \odot G)

    (right projections: :math:`X Q^	op`), with decoupled weight decay. ``xs``: the low-rank
    :math:`X = N - R \odot c` of each matrix (None: Fira-only-scaling has no low-rank term);
    ``cs``: the scale of :math:`G`'s columns or rows (None: GaLore adds no residual). The
    released arithmetic does not multiply the scaled residual by alpha (ANCHORS.md).
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


def _foreach_direction(lows, states, step, hp: Hyper) -> list[torch.Tensor]:
    """:func:`fira_optim.subspace.base_direction` for many matrices at once."""
    beta1, beta2 = hp.betas
    if hp.base == "adam":
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        if _fused_adam_supported(lows, exp_avgs, exp_avg_sqs):
            return _fused_adam_direction(lows, exp_avgs, exp_avg_sqs, step, hp)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, lows, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, lows, lows, value=1.0 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, hp.eps)
        directions = torch._foreach_div(exp_avgs, denom)
        if hp.direction_bias_corrected():
            torch._foreach_mul_(directions, adam_bias_correction(step, beta1, beta2))
        return directions
    return [
        base_direction(hp.base, low, state, step, hp.betas, hp.eps, hp.direction_bias_corrected())
        for low, state in zip(lows, states)
    ]


#: Devices with torch's fused Adam kernel (``torch._fused_adam_``), and its dtypes here.
FUSED_ADAM_DEVICES = ("cpu", "cuda")
FUSED_ADAM_DTYPES = (torch.float32, torch.float64)


def _fused_adam_supported(*lists: list[torch.Tensor]) -> bool:
    first = lists[0][0]
    return (first.device.type in FUSED_ADAM_DEVICES and first.dtype in FUSED_ADAM_DTYPES
            and hasattr(torch, "_fused_adam_")
            # the kernel's own restrictions (CUDA's raise rather than fall back): plain dense
            # tensors of one device and dtype, each shaped and strided like its R
            and all(type(t) is torch.Tensor and t.device == first.device and t.dtype == first.dtype
                    and t.is_contiguous() for ts in lists for t in ts)
            and all(len({t.shape for t in row}) == 1 for row in zip(*lists)))


def _fused_adam_direction(lows, exp_avgs, exp_avg_sqs, step: int, hp: Hyper) -> list[torch.Tensor]:
    r"""Algorithm 1's Adam on ``R`` in one pass per matrix: torch's fused Adam kernel, run on
    zero "parameters" with a negative learning rate so that the "parameter" it writes is
    the direction itself.

    The kernel computes :math:`\theta - \frac{lr}{1-\beta_1^t} \cdot
    \frac{M}{\sqrt{V}/\sqrt{1-\beta_2^t} + \epsilon'}`. With :math:`\theta = 0` and
    :math:`\epsilon' = \epsilon / \sqrt{1-\beta_2^t}` this is :math:`-lr \cdot b_t\,
    M / (\sqrt{V} + \epsilon)` (:math:`b_t = \sqrt{1-\beta_2^t}/(1-\beta_1^t)`), so
    :math:`lr = -1` gives Algorithm 1's :math:`N_t` and :math:`lr = -1/b_t` the released
    un-corrected :math:`M / (\sqrt{V} + \epsilon)`, equal to the ``foreach`` passes up to
    rounding. The moments are updated in place as by those passes.
    """
    beta1, beta2 = hp.betas
    correction2 = math.sqrt(1.0 - beta2**step)
    lr = -1.0 if hp.direction_bias_corrected() else -1.0 / adam_bias_correction(step, beta1, beta2)
    directions = [torch.zeros_like(low) for low in lows]
    # The kernel reads the step count from a tensor (torch.optim keeps one per parameter).
    steps = [torch.full((), float(step), dtype=torch.float32, device=lows[0].device)] * len(lows)
    torch._fused_adam_(directions, lows, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1,
                       beta2=beta2, weight_decay=0.0, eps=hp.eps / correction2, amsgrad=False,
                       maximize=False)
    return directions


def _foreach_scaling(directions, low_norms, dims, hp: Hyper) -> list[torch.Tensor]:
    eps = hp.residual_eps
    if hp.scaling == "column":
        dn = [norms(d, dim) for d, dim in zip(directions, dims)]
        return torch._foreach_div(dn, torch._foreach_add(low_norms, eps))
    if hp.scaling == "matrix":
        dn = torch._foreach_norm(directions)
        return torch._foreach_div(dn, torch._foreach_add(torch._foreach_norm(low_norms), eps))
    return [torch.ones((), dtype=d.dtype, device=d.device) for d in directions]


def _sharded_matrix_scaling(directions, lows, row_sum, hp: Hyper) -> list[torch.Tensor]:
    """Matrix-level phi = ||N|| / (||R|| + eps) of row-sharded ``N`` and ``R`` (right side)."""
    squares = torch.stack([t.square().sum() for pair in zip(directions, lows) for t in pair])
    norms = row_sum(squares).sqrt()
    return [norms[2 * i] / (norms[2 * i + 1] + hp.residual_eps) for i in range(len(directions))]


def _row_sum_many(tensors: list[torch.Tensor], row_sum: RowSum) -> None:
    """``row_sum`` applied to each of ``tensors`` in place, in one collective."""
    if not tensors:
        return
    flat = row_sum(torch.cat([t.reshape(-1) for t in tensors]))
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _limit_many(hp: Hyper, norms: torch.Tensor, prev: list[torch.Tensor]) -> list[torch.Tensor]:
    """The limiter for a stack of matrices; updates each ``prev_norm`` in place."""
    factors = limiter_factor(
        hp.limiter,
        norms,
        torch.stack(prev),
        gamma=hp.gamma,
        eps=hp.residual_eps,
        clip_norm=hp.clip_norm,
        mu=hp.mu,
    )
    torch._foreach_copy_(prev, list((norms * factors).unbind()))
    return list(factors.unbind())


def _addmm(param: torch.Tensor, basis: torch.Tensor, low: torch.Tensor, side: str, alpha: float) -> None:
    """``param += alpha * (P low)`` (left) or ``alpha * (low Q^T)`` (right), in place."""
    if side == LEFT:
        param.addmm_(basis, low, alpha=alpha)
    else:
        param.addmm_(low, basis.T, alpha=alpha)


def fast_path_supports(hp: Hyper, param: torch.Tensor, grad: torch.Tensor) -> bool:
    """The fast path covers everything but FRUGAL's sign residual and low-precision params."""
    return hp.residual != "sign" and param.dtype == grad.dtype
