r"""The low-rank arithmetic of a Fira step as one ``torch.compile``-d kernel per matrix.

:func:`fira_optim.update.apply_fast` runs Adam on :math:`R` in torch's fused Adam kernel, then
the scaling factors and the limiter as several ``foreach`` passes over the small ``r x n``
tensors; on a CPU (no multi-tensor kernels) and on a GPU (one launch per op and matrix) those
passes, not the two GEMMs, are what separates a step from its floor. Here the same arithmetic,

.. math::
    \begin{aligned}
    &M \leftarrow \beta_1 M + (1-\beta_1) R, \quad V \leftarrow \beta_2 V + (1-\beta_2) R^2,
      \quad N = b_t\, M / (\sqrt{V} + \epsilon) \\
    &\phi_i = \|N_{:,i}\| / (\|R_{:,i}\| + \epsilon), \quad
      \|S\| = \big(\textstyle\sum_i \phi_i^2 \max(\|g_i\|^2 - k\|r_i\|^2, 0)\big)^{1/2} \\
    &f = \gamma / \max(\|S\| / (\|S_{t-1}\| + \epsilon), \gamma), \quad c = f\phi, \quad
      X = N - R \odot c
    \end{aligned}

(``k = 1``, or ``2 alpha - alpha^2`` for the released residual), is one function that
TorchInductor fuses into a couple of loops (C++/OpenMP on CPU, Triton on CUDA). The caller
then adds ``P X`` (one GEMM) and ``c * G`` (one pass) into the parameter, as the fast path
does. Opt in with ``implementation="compiled"``: the first step compiles (seconds to a
minute, cached on disk by torch for later processes), so it pays off on long runs.

Covered: Adam base; column or no scaling; growth or no limiter; residual added or dropped;
one process. Everything else in the same optimizer falls back to the fast path.
"""

from __future__ import annotations

import warnings

import torch

from .projection import reduce_dim, sq_norms
from .subspace import adam_bias_correction
from .update import Hyper, add_update


def supports(hp: Hyper) -> bool:
    """Whether the compiled kernel covers this group's hyper-parameters."""
    return (
        hp.base == "adam"
        and hp.scaling in ("column", "none")
        and hp.limiter in ("growth", "none")
        and hp.residual in ("add", "drop")
        and not hp.only_scaling
    )


#: Order of the hyper-parameters in the ``scalars`` tensor that :func:`_core` reads. They are
#: tensor entries, not Python numbers or flags: every distinct constant would be a new
#: specialisation (a recompilation) of the kernel, and the bias correction changes every step.
SCALARS = ("beta1", "beta2", "eps", "residual_eps", "gamma", "low_coef", "bias_correction",
           "use_scaling", "use_limiter", "keep_residual")


def _core(low, low_norm, g_sq, exp_avg, exp_avg_sq, prev_norm, scalars, dim: int):
    """One matrix: updates the moments and ``prev_norm`` in place, returns ``(X, c)``."""
    beta1, beta2, eps, residual_eps, gamma, low_coef, correction, use_scaling, use_limiter, keep = (
        scalars.unbind())
    exp_avg.mul_(beta1).add_(low * (1.0 - beta1))
    exp_avg_sq.mul_(beta2).add_(low * low * (1.0 - beta2))
    direction = exp_avg / (exp_avg_sq.sqrt() + eps) * correction
    column = torch.linalg.vector_norm(direction, dim=dim, keepdim=True) / (low_norm + residual_eps)
    phi = torch.where(use_scaling > 0, column, torch.ones_like(column))
    outside_sq = (g_sq - low_coef * low_norm * low_norm).clamp_min(0.0)
    norm = (phi * phi * outside_sq).sum().sqrt()
    limited = gamma / torch.clamp(norm / (prev_norm + residual_eps), min=gamma)
    factor = torch.where((use_limiter > 0) & (prev_norm > 0), limited, torch.ones_like(norm))
    prev_norm.copy_(norm * factor)
    c = phi * factor * keep  # keep = 0: GaLore (no residual), X = N
    return direction - low * c, c


_compiled = None
_failed: str | None = None


def _kernel():
    """The compiled :func:`_core` (compilation itself happens at its first call)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_core, fullgraph=True)
    return _compiled


def apply_compiled(params, grads, lows, low_norms, bases, sides, states, step: int, hp: Hyper,
                   grad_sqs=None) -> bool:
    """:func:`fira_optim.update.apply_fast` for one bucket, with the fused kernel.

    Returns ``False`` with nothing modified if torch.compile is unavailable here (no C++
    compiler, say), so that the caller runs the fast path instead."""
    global _failed
    if _failed is not None:
        return False
    beta1, beta2 = hp.betas
    correction = adam_bias_correction(step, beta1, beta2) if hp.direction_bias_corrected() else 1.0
    values = dict(
        beta1=beta1, beta2=beta2, eps=hp.eps, residual_eps=hp.residual_eps, gamma=hp.gamma,
        low_coef=(2.0 * hp.alpha - hp.alpha**2) if hp.released else 1.0,
        bias_correction=correction, use_scaling=float(hp.scaling == "column"),
        use_limiter=float(hp.limiter == "growth"), keep_residual=float(hp.residual == "add"),
    )
    kernel = _kernel()
    updates = []
    grad_sqs = grad_sqs or [None] * len(grads)
    scalars = None
    for i, (grad, low, low_norm, side, state, grad_sq) in enumerate(
            zip(grads, lows, low_norms, sides, states, grad_sqs)):
        dim = reduce_dim(side)
        if scalars is None or scalars.dtype != low.dtype or scalars.device != low.device:
            scalars = torch.tensor([values[k] for k in SCALARS], dtype=low.dtype, device=low.device)
        if hp.residual == "drop":  # no residual, no limiter history: placeholders
            g_sq, prev = low_norm.square(), low_norm.new_zeros(())
        else:
            g_sq = grad_sq if grad_sq is not None else sq_norms(grad, dim)
            prev = state["prev_norm"]
        try:
            updates.append(kernel(low, low_norm, g_sq, state["exp_avg"], state["exp_avg_sq"], prev,
                                  scalars, dim))
        except Exception as err:  # noqa: BLE001 (a compiler failure fails before running)
            if i > 0:  # earlier matrices' moments are already updated: no clean fallback
                raise
            _failed = f"{type(err).__name__}: {err}"
            warnings.warn(f"implementation='compiled' is unavailable ({_failed}); using the "
                          "multi-tensor fast path", RuntimeWarning, stacklevel=4)
            return False
    xs, cs = zip(*updates)
    add_update(params, grads, bases, sides, xs, None if hp.residual == "drop" else cs, step, hp)
    return True
