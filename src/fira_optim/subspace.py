r"""The adaptive optimizer that runs inside the low-rank subspace: :math:`N_t = \psi_t(R_t)`.

Fira is plug-and-play over the base optimizer (Appendix A.2 and the Adagrad table of the
paper). Each base here updates its state tensors in place and returns the corrected
low-rank gradient ``N``; nothing else of Fira depends on which base produced it.

Adam (Algorithm 1):

.. math::
    M_t = \beta_1 M_{t-1} + (1-\beta_1) R_t, \quad
    V_t = \beta_2 V_{t-1} + (1-\beta_2) R_t^2, \quad
    N_t = \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t} \cdot \frac{M_t}{\sqrt{V_t} + \epsilon}

With ``bias_corrected=False`` the leading factor is left out (the released ``fira`` folds it
into the step size instead, which changes what the scaling factor and limiter see).

Adagrad: :math:`A_t = A_{t-1} + R_t^2,\ N_t = R_t / (\sqrt{A_t} + \epsilon)`.
RMSProp: :math:`A_t = \beta_2 A_{t-1} + (1-\beta_2) R_t^2,\ N_t = R_t / (\sqrt{A_t} + \epsilon)`.
"""

from __future__ import annotations

import math

import torch

BASES = ("adam", "adagrad", "rmsprop")

#: The state tensors (all shaped like ``R``) that each base keeps, in torch.optim's names.
STATE_KEYS = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "adagrad": ("sum",),
    "rmsprop": ("square_avg",),
}


def adam_bias_correction(step: int, beta1: float, beta2: float) -> float:
    r""":math:`\sqrt{1-\beta_2^t} / (1-\beta_1^t)`."""
    return math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


def adam_direction(
    low: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    beta1: float,
    beta2: float,
    eps: float,
    bias_corrected: bool = True,
) -> torch.Tensor:
    exp_avg.mul_(beta1).add_(low, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(low, low, value=1.0 - beta2)
    direction = exp_avg / exp_avg_sq.sqrt().add_(eps)
    if bias_corrected:
        direction.mul_(adam_bias_correction(step, beta1, beta2))
    return direction


def adagrad_direction(low: torch.Tensor, total: torch.Tensor, eps: float) -> torch.Tensor:
    total.addcmul_(low, low)
    return low / total.sqrt().add_(eps)


def rmsprop_direction(low: torch.Tensor, square_avg: torch.Tensor, beta2: float, eps: float) -> torch.Tensor:
    square_avg.mul_(beta2).addcmul_(low, low, value=1.0 - beta2)
    return low / square_avg.sqrt().add_(eps)


def base_direction(
    base: str,
    low: torch.Tensor,
    state: dict,
    step: int,
    betas: tuple[float, float],
    eps: float,
    bias_corrected: bool = True,
) -> torch.Tensor:
    """Run ``base`` on the low-rank gradient ``low``, updating ``state`` in place."""
    beta1, beta2 = betas
    if base == "adam":
        return adam_direction(
            low, state["exp_avg"], state["exp_avg_sq"], step, beta1, beta2, eps, bias_corrected
        )
    if base == "adagrad":
        return adagrad_direction(low, state["sum"], eps)
    if base == "rmsprop":
        return rmsprop_direction(low, state["square_avg"], beta2, eps)
    raise ValueError(f"Invalid base: {base!r}; expected one of {BASES}")
