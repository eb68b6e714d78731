r"""Learning-rate schedules, as multipliers of the peak learning rate (for ``LambdaLR``).

The paper's schedule (Appendix B, after GaLore): a linear warm-up over the first 10% of the
steps, then cosine annealing to 10% of the peak. For optimizer step :math:`s = 0, 1, \dots, S-1`
with :math:`W` warm-up steps and floor :math:`\rho`:

.. math::
    f(s) = \frac{s + 1}{W} \quad (s < W), \qquad
    f(s) = \rho + (1 - \rho)\,\tfrac12\left(1 + \cos \pi \frac{s - W}{S - W}\right) \quad (s \ge W).

(GaLore's harness uses :math:`s / W` during warm-up, which spends step 0 at learning rate 0;
we start at :math:`1/W` so that every step trains.)

ReLoRA's *jagged* schedule multiplies :math:`f` by a short linear re-warm-up after each
restart of the adapters, at steps :math:`c, 2c, \dots`: :math:`\min(1, (s - kc + 1) / w)` for
:math:`kc \le s < kc + w`, :math:`k \ge 1`.
"""

from __future__ import annotations

import math


def warmup_steps_for(steps: int, warmup_fraction: float) -> int:
    """Warm-up length in steps: ``round(warmup_fraction * steps)``."""
    return int(round(warmup_fraction * steps))


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """The multiplier :math:`f(s)` above for 0-indexed optimizer step ``step``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def restart_rewarmup(step: int, cycle: int, rewarmup: int) -> float:
    """ReLoRA's re-warm-up factor: ramps linearly from ``1/rewarmup`` to 1 after each restart."""
    restart = (step // cycle) * cycle
    if restart == 0 or step - restart >= rewarmup:
        return 1.0
    return (step - restart + 1) / rewarmup


class WarmupCosine:
    """Picklable (plain-attribute) ``LambdaLR`` multiplier: warm-up + cosine, optionally jagged."""

    def __init__(self, total_steps: int, warmup_fraction: float, min_ratio: float,
                 restart_every: int | None = None, rewarmup: int = 1) -> None:
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps_for(total_steps, warmup_fraction)
        self.min_ratio = min_ratio
        self.restart_every = restart_every
        self.rewarmup = rewarmup

    def __call__(self, step: int) -> float:
        factor = warmup_cosine(step, self.total_steps, self.warmup_steps, self.min_ratio)
        if self.restart_every is not None:
            factor *= restart_rewarmup(step, self.restart_every, self.rewarmup)
        return factor
