r"""Confidence intervals for an accuracy and the paired test between two models on the same examples.

**Wilson score interval** (no continuity correction) for k correct of n, :math:`\hat p = k/n`,
:math:`z = \Phi^{-1}(1 - (1 - \text{level})/2)` (1.96 at 95%):

.. math::

    \frac{\hat p + \frac{z^2}{2n}}{1 + \frac{z^2}{n}}
    \pm \frac{z}{1 + \frac{z^2}{n}} \sqrt{\frac{\hat p (1 - \hat p)}{n} + \frac{z^2}{4 n^2}}

It stays inside [0, 1] and keeps close to its nominal coverage at small n and at accuracies
near 0 or 1, where the normal interval :math:`\hat p \pm z \sqrt{\hat p(1-\hat p)/n}` does not.

**McNemar's exact test** for two models scored on the same n examples: only the discordant
examples carry information, b where only A is right and c where only B is right. Under the null
hypothesis of equal accuracy each discordant example is A's or B's with probability 1/2, so
:math:`b \sim \mathrm{Binomial}(b + c, 1/2)` and the two-sided p-value is

.. math::

    p = \min\Bigl(1,\; 2 \sum_{i=0}^{\min(b, c)} \binom{b + c}{i} 2^{-(b + c)}\Bigr)

(1 when b = c; computed in exact integer arithmetic). It is the exact binomial test of b
against 1/2 (``scipy.stats.binomtest(b, b + c).pvalue``).
"""

from __future__ import annotations

import math
from fractions import Fraction
from statistics import NormalDist

__all__ = ["wilson_interval", "mcnemar_exact"]


def wilson_interval(correct: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` of the accuracy ``correct / n`` at confidence ``level``."""
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"n={n!r} must be a positive integer (an interval needs examples)")
    if not isinstance(correct, int) or not 0 <= correct <= n:
        raise ValueError(f"correct={correct!r} must be an integer in [0, n={n}]")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level!r} must be in (0, 1), e.g. 0.95")
    z = NormalDist().inv_cdf(1.0 - (1.0 - level) / 2.0)
    p = correct / n
    denominator = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (``only_a``: A right and B wrong)."""
    for name, value in (("only_a", only_a), ("only_b", only_b)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be a non-negative integer (a count of examples)")
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1))
    return float(min(Fraction(1), Fraction(2 * tail, 2**n)))
