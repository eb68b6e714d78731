"""The statistics of a sweep: mean and sample standard deviation over seeds, and the paired
difference between two methods with its 95% interval.

A paired difference uses the seeds both methods ran: seed ``s`` gives both runs the same
initialisation and data order, so ``d_s = x_s - y_s`` removes what the seed does to both. With
``n`` seeds, mean ``d``, sample standard deviation ``s_d``:

    95% interval = d  ±  t_{0.975, n-1} * s_d / sqrt(n)        (Student's t, n >= 2)

With one seed there is no interval (``None``): one seed is not evidence of an ordering.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import stats


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation (``None`` below 2 values) of ``n`` values."""

    mean: float
    sd: float | None
    n: int


@dataclass(frozen=True)
class PairedDifference:
    """``mean`` of ``x_s - y_s`` over the ``n`` shared seeds, its 95% interval ``(low, high)``
    (``None`` below 2 seeds) and the seeds used."""

    mean: float
    low: float | None
    high: float | None
    n: int
    seeds: tuple[int, ...]

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies on one side of 0 (a difference at the 95% level)."""
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)


def spread(values: Sequence[float]) -> Spread:
    """Mean and sample standard deviation (ddof 1) of ``values`` (at least one)."""
    if not values:
        raise ValueError("spread needs at least one value, got none")
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return Spread(mean, None, n)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return Spread(mean, sd, n)


def mean_interval(values: Sequence[float]) -> tuple[float, float | None, float | None]:
    """Mean of ``values`` and its 95% Student's t interval ``(mean, low, high)``; ``None`` bounds
    below 2 values."""
    summary = spread(values)
    if summary.sd is None:
        return summary.mean, None, None
    half = float(stats.t.ppf(0.975, summary.n - 1)) * summary.sd / math.sqrt(summary.n)
    return summary.mean, summary.mean - half, summary.mean + half


def paired_difference(x: Mapping[int, float], y: Mapping[int, float]) -> PairedDifference | None:
    """The paired difference ``x - y`` over the seeds in both (``{seed: value}``); ``None`` when
    they share no seed. A diverged run (``inf``) on a seed makes the difference ``+inf`` or
    ``-inf`` when every such seed points the same way, else ``nan`` (both diverged: no order)."""
    seeds = tuple(sorted(x.keys() & y.keys()))
    if not seeds:
        return None
    infinite = [s for s in seeds if not (math.isfinite(x[s]) and math.isfinite(y[s]))]
    if infinite:  # a diverged run: the difference has a direction at best, no size
        signs = {1 if x[s] > y[s] else -1 if x[s] < y[s] else 0 for s in infinite}
        direction = math.inf * signs.pop() if len(signs) == 1 and 0 not in signs else math.nan
        return PairedDifference(direction, None, None, len(seeds), seeds)
    mean, low, high = mean_interval([x[s] - y[s] for s in seeds])
    return PairedDifference(mean, low, high, len(seeds), seeds)
