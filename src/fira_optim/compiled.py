r"""The compiled strategy: stages 3-6 of a Fira step fused into one ``torch.compile``-d kernel
per matrix.

The fast strategy (:data:`fira_optim.pipeline.FAST`) runs Adam on :math:`R` in torch's fused
Adam kernel, then the scaling factors and the limiter as several ``foreach`` passes over the
small ``r x n`` tensors; on a CPU (no multi-tensor kernels) and on a GPU (one launch per op and
matrix) those passes, not the two GEMMs, are what separates a step from its floor. Here the
same stages,

.. math::
    \begin{aligned}
    &M \leftarrow \beta_1 M + (1-\beta_1) R, \quad V \leftarrow \beta_2 V + (1-\beta_2) R^2,
      \quad N = b_t\, M / (\sqrt{V} + \epsilon) \\
    &\phi_i = \|N_{:,i}\| / (\|R_{:,i}\| + \epsilon), \quad
      \|S\| = \big(\textstyle\sum_i \phi_i^2 \max(\|g_i\|^2 - k\|r_i\|^2, 0)\big)^{1/2} \\
    &f = \gamma / \max(\|S\| / (\|S_{t-1}\| + \epsilon), \gamma), \quad c = f\phi, \quad
      X = N - R \odot c
    \end{aligned}

(``k = 1``, or ``2 alpha - alpha^2`` for the released residual), are one function that
TorchInductor fuses into a couple of loops (C++/OpenMP on CPU, Triton on CUDA); the limiter is
:func:`fira_optim.limiter.limiter_factor` itself. Stage 7 is the fast strategy's commit
(:func:`fira_optim.commit.add_update`: ``P X`` by one GEMM, ``c * G`` by one pass). Opt in with
``implementation="compiled"``: the first step compiles (seconds to a minute, cached on disk by
torch for later processes). Measured (docs/benchmarks.md), its steady CPU step is within a few
percent of the fast strategy's, and on a GPU the per-matrix kernel calls are slower.

Covered: Adam base; column or no scaling; growth or no limiter; residual added or dropped;
one process. Everything else in the same optimizer runs the fast strategy.
"""

from __future__ import annotations

import warnings

import torch

from .commit import add_update
from .limiter import limiter_factor
from .options import Base, Hyper, Limiter, Residual, Scaling, adam_bias_correction
from .pipeline import FAST, FastStrategy, MatrixStats, MatrixStep
from .projection import norms, sq_norms
from .residual import cancelled, explicit_residuals
from .scaling import RowSum, scaling_factors
from .subspace import adam_directions


def supports(hp: Hyper) -> bool:
    """Whether the compiled kernel covers this group's hyper-parameters."""
    return (
        hp.base is Base.ADAM
        and hp.scaling in (Scaling.COLUMN, Scaling.NONE)
        and hp.limiter in (Limiter.GROWTH, Limiter.NONE)
        and hp.residual in (Residual.ADD, Residual.DROP)
        and not hp.only_scaling
    )


#: Order of the hyper-parameters in the ``scalars`` tensor that :func:`_core` reads. They are
#: tensor entries, not Python numbers or flags: every distinct constant would be a new
#: specialisation (a recompilation) of the kernel, and the bias correction changes every step.
SCALARS = ("beta1", "beta2", "eps", "residual_eps", "gamma", "low_coef", "bias_correction",
           "use_scaling", "use_limiter", "keep_residual")


def _core(low, low_norm, g_sq, exp_avg, exp_avg_sq, prev_norm, scalars, dim: int):
    """One matrix: updates the moments in place, returns ``(X, c, ||S||, f, f ||S||, ||phi G||)``.

    The new history ``f ||S||`` is returned, not written into ``prev_norm``: TorchInductor (torch
    2.13, CPU) dropped that write to a 0-d float64 input, and the caller may still correct
    ``||S||`` (:func:`fira_optim.residual.cancelled`)."""
    beta1, beta2, eps, residual_eps, gamma, low_coef, correction, use_scaling, use_limiter, keep = (
        scalars.unbind())
    exp_avg.mul_(beta1).add_(low * (1.0 - beta1))
    exp_avg_sq.mul_(beta2).add_(low * low * (1.0 - beta2))
    direction = exp_avg / (exp_avg_sq.sqrt() + eps) * correction
    column = torch.linalg.vector_norm(direction, dim=dim, keepdim=True) / (low_norm + residual_eps)
    phi = torch.where(use_scaling > 0, column, torch.ones_like(column))
    outside_sq = (g_sq - low_coef * low_norm * low_norm).clamp_min(0.0)
    norm = (phi * phi * outside_sq).sum().sqrt()
    whole = (phi * phi * g_sq).sum().sqrt()
    factor = _factor(norm, prev_norm, gamma, residual_eps, use_limiter)
    c = phi * factor * keep  # keep = 0: GaLore (no residual), X = N
    return direction - low * c, c, norm, factor, norm * factor, whole


def _factor(norm, prev_norm, gamma, eps, use_limiter):
    """The growth limiter's factor, or 1 where ``use_limiter`` is 0."""
    growth = limiter_factor(Limiter.GROWTH, norm, prev_norm, gamma=gamma, eps=eps, clip_norm=1.0, mu=1.0)
    return torch.where(use_limiter > 0, growth, torch.ones_like(norm))


_compiled = None
_failed: str | None = None


def _kernel():
    """The compiled :func:`_core` (compilation itself happens at its first call)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_core, fullgraph=True)
    return _compiled


class CompiledStrategy(FastStrategy):
    """The fast strategy with stages 3-6 of each matrix in the compiled kernel; it runs the fast
    strategy itself where the kernel does not cover the group (:func:`supports`), under FSDP2,
    or where torch.compile is unavailable."""

    def run(self, batch: list[MatrixStep], step: int, hp: Hyper, row_sum: RowSum = None,
            stats=None) -> None:
        if row_sum is not None or not supports(hp) or not _run_compiled(batch, step, hp, stats):
            FAST.run(batch, step, hp, row_sum, stats)


COMPILED = CompiledStrategy("compiled", explicit=False, fused_adam=True, column_norms=norms)


def _run_compiled(batch: list[MatrixStep], step: int, hp: Hyper, stats) -> bool:
    """Stages 3-7 of ``batch`` with the fused kernel. Returns ``False`` with nothing modified if
    torch.compile is unavailable here (no C++ compiler, say)."""
    global _failed
    if _failed is not None:
        return False
    beta1, beta2 = hp.betas
    correction = adam_bias_correction(step, beta1, beta2) if hp.direction_bias_corrected() else 1.0
    values = dict(
        beta1=beta1, beta2=beta2, eps=hp.eps, residual_eps=hp.residual_eps, gamma=hp.gamma,
        low_coef=hp.residual_coef, bias_correction=correction,
        use_scaling=float(hp.scaling is Scaling.COLUMN),
        use_limiter=float(hp.limiter is Limiter.GROWTH), keep_residual=float(hp.residual is Residual.ADD),
    )
    kernel = _kernel()
    updates = []
    scalars = None
    for i, m in enumerate(batch):
        low, low_norm, state = m.low, m.low_norm, m.state
        if scalars is None or scalars.dtype != low.dtype or scalars.device != low.device:
            scalars = torch.tensor([values[k] for k in SCALARS], dtype=low.dtype, device=low.device)
        if hp.residual is Residual.DROP:  # no residual, no limiter history: placeholders
            g_sq, prev = low_norm.square(), low_norm.new_zeros(())
        else:
            g_sq = m.grad_sq if m.grad_sq is not None else sq_norms(m.grad, m.dim)
            prev = state["prev_norm"]
        try:
            updates.append(kernel(low, low_norm, g_sq, state["exp_avg"], state["exp_avg_sq"], prev,
                                  scalars, m.dim))
        except Exception as err:  # noqa: BLE001 (a compiler failure fails before running)
            if i > 0:  # earlier matrices' moments are already updated: no clean fallback
                raise
            _failed = f"{type(err).__name__}: {err}"
            warnings.warn(f"implementation='compiled' is unavailable ({_failed}); using the "
                          "multi-tensor fast path", RuntimeWarning, stacklevel=5)
            return False
    xs, cs, norms_, factors, histories, wholes = map(list, zip(*updates))
    drop = hp.residual is Residual.DROP
    if not drop:
        for i in cancelled(torch.stack(norms_), torch.stack(wholes)):
            xs[i], cs[i], norms_[i], factors[i], histories[i] = _exact_norm(batch[i], step, hp)
        torch._foreach_copy_([m.state["prev_norm"] for m in batch], histories)
    add_update([m.local for m in batch], [m.grad for m in batch], [m.basis for m in batch],
               [m.side for m in batch], xs, None if drop else cs, step, hp)
    if stats is not None:
        stats.extend(MatrixStats(m.param, "compiled", None if drop else n, None if drop else f)
                     for m, n, f in zip(batch, norms_, factors))
    return True


def _exact_norm(m: MatrixStep, step: int, hp: Hyper) -> tuple:
    """``(X, c, ||S||, f, f ||S||)`` of a matrix whose kernel-computed ``||S||`` kept too few bits
    (:func:`fira_optim.residual.cancelled`: rare, at refreshes), from the norm of its ``S`` formed
    explicitly, as the fast strategy does. ``N`` and ``phi`` are computed again from the moments
    the kernel updated (returning them from the kernel cost every step an ``r x n`` output)."""
    direction = adam_directions([m.state["exp_avg"]], [m.state["exp_avg_sq"]], step, hp)[0]
    phi = scaling_factors([direction], [m.low], [m.low_norm], [m.dim], hp.scaling, hp.residual_eps)[0]
    exact, _ = explicit_residuals([m.grad], [m.low], [m.basis], [m.side], [phi], hp)
    factor = limiter_factor(hp.limiter, exact[0], m.state["prev_norm"], gamma=hp.gamma, eps=hp.residual_eps,
                            clip_norm=1.0, mu=1.0)  # growth or none (supports)
    c = phi * factor
    return direction - m.low * c, c, exact[0], factor, exact[0] * factor
