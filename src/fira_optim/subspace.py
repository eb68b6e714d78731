r"""Stage 3 of Algorithm 1, the low-rank direction :math:`N_t = \psi_t(R_t)`: the adaptive
optimizer that runs inside the subspace, for a batch of matrices.

Fira is plug-and-play over the base optimizer (Appendix A.2 and the Adagrad table of the
paper). Each base updates its state tensors in place and returns ``N``; nothing else of Fira
depends on which base produced it.

Adam (Algorithm 1):

.. math::
    M_t = \beta_1 M_{t-1} + (1-\beta_1) R_t, \quad
    V_t = \beta_2 V_{t-1} + (1-\beta_2) R_t^2, \quad
    N_t = \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t} \cdot \frac{M_t}{\sqrt{V_t} + \epsilon}

Without bias correction (the released ``fira``, which folds it into the step size instead)
the leading factor is left out.

Adagrad: :math:`A_t = A_{t-1} + R_t^2,\ N_t = R_t / (\sqrt{A_t} + \epsilon)`.
RMSProp: :math:`A_t = \beta_2 A_{t-1} + (1-\beta_2) R_t^2,\ N_t = R_t / (\sqrt{A_t} + \epsilon)`.

Two kernels run Adam: ``foreach`` passes (any tensors) and one pass of torch's fused Adam
kernel (:func:`fused_adam_direction`; plain dense CPU/CUDA tensors). The compiled strategy
brings a third, fused with the later stages (:mod:`fira_optim.compiled`).
"""

from __future__ import annotations

import math

import torch

from .options import BASES, Base, Hyper, adam_bias_correction

__all__ = ["BASES", "STATE_KEYS", "adam_bias_correction", "low_rank_directions"]

#: The state tensors (all shaped like ``R``) that each base keeps, in torch.optim's names.
STATE_KEYS = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "adagrad": ("sum",),
    "rmsprop": ("square_avg",),
}


def low_rank_directions(lows: list[torch.Tensor], states: list[dict], step: int, hp: Hyper, *,
                        fused: bool) -> list[torch.Tensor]:
    """``N`` of each ``R`` in ``lows``, updating each state in place.

    ``step`` is the step count after the increment (1 on the first update). ``fused``: run
    Adam through torch's fused kernel where it supports the tensors (else ``foreach``).
    """
    beta1, beta2 = hp.betas
    if hp.base is Base.ADAM:
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        if fused and fused_adam_supported(lows, exp_avgs, exp_avg_sqs):
            return fused_adam_direction(lows, exp_avgs, exp_avg_sqs, step, hp)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, lows, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, lows, lows, value=1.0 - beta2)
        return adam_directions(exp_avgs, exp_avg_sqs, step, hp)
    totals = [s["sum" if hp.base is Base.ADAGRAD else "square_avg"] for s in states]
    if hp.base is Base.ADAGRAD:
        torch._foreach_addcmul_(totals, lows, lows)
    else:
        torch._foreach_mul_(totals, beta2)
        torch._foreach_addcmul_(totals, lows, lows, value=1.0 - beta2)
    denom = torch._foreach_sqrt(totals)
    torch._foreach_add_(denom, hp.eps)
    return torch._foreach_div(lows, denom)


def adam_directions(exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], step: int,
                    hp: Hyper) -> list[torch.Tensor]:
    r""":math:`N = b_t M / (\sqrt{V} + \epsilon)` from moments already updated (bias correction
    :math:`b_t` where the arithmetic is the paper's)."""
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, hp.eps)
    directions = torch._foreach_div(exp_avgs, denom)
    if hp.direction_bias_corrected():
        torch._foreach_mul_(directions, adam_bias_correction(step, *hp.betas))
    return directions


#: Devices with torch's fused Adam kernel (``torch._fused_adam_``), and its dtypes here.
FUSED_ADAM_DEVICES = ("cpu", "cuda")
FUSED_ADAM_DTYPES = (torch.float32, torch.float64)


def fused_adam_supported(*lists: list[torch.Tensor]) -> bool:
    """Whether the fused kernel takes these lists (``R``, then each state)."""
    first = lists[0][0]
    return (first.device.type in FUSED_ADAM_DEVICES and first.dtype in FUSED_ADAM_DTYPES
            and hasattr(torch, "_fused_adam_")
            # the kernel's own restrictions (CUDA's raise rather than fall back): plain dense
            # tensors of one device and dtype, each shaped and strided like its R
            and all(type(t) is torch.Tensor and t.device == first.device and t.dtype == first.dtype
                    and t.is_contiguous() for ts in lists for t in ts)
            and all(len({t.shape for t in row}) == 1 for row in zip(*lists)))


def fused_adam_direction(lows, exp_avgs, exp_avg_sqs, step: int, hp: Hyper) -> list[torch.Tensor]:
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
