r"""Variance of Fira's scaling factor early in training (paper Appendix E.2, Theorem 2).

Setting (the paper's, after Liu et al. 2019, "On the variance of the adaptive learning rate"):
gradients :math:`g^{(i)}_j \sim \mathcal{N}(0, \sigma^2)`, independent over the ``n`` entries
``i`` of one column of :math:`R_t` (``n = r``, the rank) and over steps ``j``. Adam's adaptive
learning rate of entry ``i`` at step ``t`` is

.. math::
    \psi_i = \sqrt{\frac{1 - \beta_2^t}{(1 - \beta_2) \sum_{j=1}^{t} \beta_2^{t-j} (g^{(i)}_j)^2}}
           = \hat v_{t,i}^{-1/2},

and Fira's column-wise scaling factor (``||psi(R)|| / ||R||`` with the first moment dropped,
as in the theorem) is

.. math::
    \phi^2 = \frac{\sum_{i=1}^n \psi_i^2 (g^{(i)}_t)^2}{\sum_{i=1}^n (g^{(i)}_t)^2}
           = \sum_i w_i \psi_i^2, \qquad w_i = \frac{(g^{(i)}_t)^2}{\sum_k (g^{(k)}_t)^2}.

**Theorem 2.** If the :math:`\psi_i^2` are i.i.d., independent of the current gradients (so of
the weights :math:`w \sim \mathrm{Dirichlet}(\tfrac12, \dots, \tfrac12)`), then
:math:`\mathrm{Var}[\phi^2] = \mathrm{Var}[\psi^2] \cdot 3 / (n + 2) \le \mathrm{Var}[\psi^2]`,
and to first order (:math:`\mathrm{Var}[\sqrt X] \approx \mathrm{Var}[X] / 4\mathrm{E}[X]`,
with :math:`\mathrm{E}[\phi^2] = \mathrm{E}[\psi^2]`) :math:`\mathrm{Var}[\phi] \approx
\mathrm{Var}[\psi] \cdot 3/(n+2)`. The paper takes :math:`\psi^2 \sim
\text{Scale-inv-}\chi^2(\rho, 1/\sigma^2)`, i.e. :math:`\psi^2 = \rho / (\sigma^2 \chi^2_\rho)`.

Two things are computed here:

* :func:`simulate_scaling_variance` -- the paper's figure: :math:`\mathrm{Var}[\phi]` against the
  step ``t`` for each rank, with :math:`\hat v_t` the exact bias-corrected EMA of Adam. It is
  run twice on the same draws: ``adam`` (:math:`\psi` from :math:`\hat v_t`, which includes
  the current gradient, as Adam and Fira compute it) and ``past`` (:math:`\psi` from
  :math:`\hat v_{t-1}`, the independence the proof assumes).
* :func:`check_theorem2` -- a Monte Carlo check of the identity itself, with independent
  Scale-inv-:math:`\chi^2` draws for :math:`\psi_i^2` and Dirichlet weights from
  :math:`\chi^2_1` draws.

:func:`run_variance_analysis` writes both to ``report.md`` and ``variance.png``.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fira_train.files import check_report_owner, refuse_links, write_text_atomic
from fira_train.report.markdown import refuse_other_commands_output
from fira_train.report.plots import plain_log_ticks, pyplot, save_figure

#: The heading of this analysis's report (a folder whose report.md has another is refused).
TITLE = "Variance of Fira's scaling factor (Appendix E.2, Theorem 2)"

DEFAULT_RANKS = (1, 5, 10, 50, 100)
REPORT_STEPS = (1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000)
RATIO_STEPS = (5, 10, 100, 1000)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return int(value)


def _seed(seed: Any) -> int:
    """A numpy seed: an int >= 0 (numpy's own error names neither the argument nor the value)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got seed={seed!r}")
    return int(seed)


def _ranks(ranks: Iterable[int]) -> tuple[int, ...]:
    ranks = tuple(ranks)
    if not ranks:
        raise ValueError(f"ranks must not be empty, got ranks={ranks!r}")
    for r in ranks:
        _positive_int("ranks", r)
    if list(ranks) != sorted(set(ranks)):
        raise ValueError(f"ranks must be strictly increasing, got ranks={ranks!r}")
    return tuple(int(r) for r in ranks)


@dataclass(frozen=True)
class VarianceCurves:
    """Sample variances of the scaling factor, one row per rank, one column per step."""

    ranks: tuple[int, ...]
    steps: np.ndarray
    """Steps ``1 .. T`` (int64, shape ``(T,)``)."""
    var_adam: np.ndarray
    """``Var[phi]`` with ``psi`` from ``v_hat_t`` (current gradient included), ``(K, T)``."""
    var_past: np.ndarray
    """``Var[phi]`` with ``psi`` from ``v_hat_{t-1}`` (independent of ``w``); NaN at ``t = 1``."""
    var_psi_adam: np.ndarray
    """``Var[psi]`` (rank 1 of the ``adam`` variant), ``(T,)``: the normaliser of the ratios."""
    var_psi_past: np.ndarray
    """``Var[psi]`` of the ``past`` variant, ``(T,)``."""
    samples: int
    beta2: float
    sigma: float
    seed: int

    def ratio(self, variant: str = "adam") -> np.ndarray:
        """``Var[phi_n] / Var[psi]`` per rank and step; Theorem 2 predicts ``3 / (n + 2)``."""
        if variant == "adam":
            return self.var_adam / self.var_psi_adam
        if variant == "past":
            return self.var_past / self.var_psi_past
        raise ValueError(f"variant must be 'adam' or 'past', got variant={variant!r}")


def simulate_scaling_variance(
    ranks: Iterable[int] = DEFAULT_RANKS,
    *,
    steps: int = 1000,
    samples: int = 10_000,
    beta2: float = 0.999,
    sigma: float = 1.0,
    seed: int = 0,
) -> VarianceCurves:
    r"""Monte Carlo ``Var[phi]`` over steps ``1..steps`` for each rank (the paper's figure).

    ``samples`` independent runs each draw ``max(ranks)`` gradient entries per step; rank
    ``n`` uses the first ``n`` of them (common random numbers: the curves share draws, so
    their differences are not sampling noise). Cost: ``samples * max(ranks) * steps`` normal
    draws (about 1e6 per 20 ms on one core).

    The population variance is infinite where :math:`\mathrm{E}[\phi^2] = \infty`: for
    ``adam`` at rank 1 and ``t <= 2`` (:math:`\hat v_t` mixes ``t`` :math:`\chi^2_1` terms and
    :math:`\mathrm{E}[1/\hat v_t] < \infty` iff ``t > 2``) and at rank <= 2 for ``t = 1``
    (:math:`\phi^2 = n/\chi^2_n`); for ``past`` at every rank for ``t <= 3``
    (:math:`\mathrm{E}[\phi^2] = \mathrm{E}[1/\hat v_{t-1}]`). The sample variance there grows
    with ``samples`` and is reported only as the curve's start.
    """
    ranks = _ranks(ranks)
    steps = _positive_int("steps", steps)
    samples = _positive_int("samples", samples)
    if samples < 2:
        raise ValueError(f"samples must be at least 2 to estimate a variance, got samples={samples}")
    if not 0.0 < beta2 < 1.0:
        raise ValueError(f"beta2 must be in (0, 1), got beta2={beta2!r}")
    if not sigma > 0.0:
        raise ValueError(f"sigma must be positive, got sigma={sigma!r}")

    rng = np.random.default_rng([_seed(seed), 0])
    width = ranks[-1]
    # Blocks [0, 1), [1, r_1), ..., [r_{K-2}, r_{K-1}) of the entry axis; a cumulative sum over
    # blocks gives the prefix sums at 1 (psi itself) and at every rank without a full cumsum.
    edges = sorted({0, 1, *ranks[:-1]} - {width})
    # Block k ends at edges[k + 1] (the last at width): the k-th cumulative block sum is the
    # prefix sum over the first ends[k] entries.
    ends = [*edges[1:], width]
    at_rank = [ends.index(r) for r in ranks]
    at_one = ends.index(1)

    var_adam = np.full((len(ranks), steps), np.nan)
    var_past = np.full((len(ranks), steps), np.nan)
    var_psi_adam = np.full(steps, np.nan)
    var_psi_past = np.full(steps, np.nan)
    ema = np.zeros((samples, width))  # (1 - beta2) * sum_j beta2^(t-j) g_j^2
    ratio = np.empty_like(ema)

    def phi_variances(inv_vhat_scale: float, g2: np.ndarray, den: np.ndarray):
        # phi^2 = sum_i g_i^2 / v_hat_i / sum_i g_i^2, and v_hat = ema / (1 - beta2^t).
        np.divide(g2, ema, out=ratio)
        num = np.cumsum(np.add.reduceat(ratio, edges, axis=1), axis=1) * inv_vhat_scale
        phi = np.sqrt(num / den)
        var = phi.var(axis=0, ddof=1)
        return var[at_rank], var[at_one]

    for t in range(1, steps + 1):
        g2 = rng.standard_normal((samples, width))
        np.square(g2, out=g2)
        g2 *= sigma * sigma
        den = np.cumsum(np.add.reduceat(g2, edges, axis=1), axis=1)
        if t > 1:  # psi from steps < t: independent of the current weights w
            var_past[:, t - 1], var_psi_past[t - 1] = phi_variances(1.0 - beta2 ** (t - 1), g2, den)
        ema *= beta2
        ema += (1.0 - beta2) * g2
        var_adam[:, t - 1], var_psi_adam[t - 1] = phi_variances(1.0 - beta2**t, g2, den)

    return VarianceCurves(
        ranks=ranks,
        steps=np.arange(1, steps + 1),
        var_adam=var_adam,
        var_past=var_past,
        var_psi_adam=var_psi_adam,
        var_psi_past=var_psi_past,
        samples=samples,
        beta2=beta2,
        sigma=sigma,
        seed=seed,
    )


def scale_inv_chi2_moments(rho: float, sigma: float = 1.0) -> dict[str, float]:
    r"""Exact moments of :math:`\psi^2 \sim \text{Scale-inv-}\chi^2(\rho, 1/\sigma^2)`
    (:math:`\psi^2 = \rho / (\sigma^2 \chi^2_\rho)`) and of :math:`\psi = \sqrt{\psi^2}`.

    :math:`\mathrm{E}[\psi^2] = \rho\tau^2/(\rho-2)`,
    :math:`\mathrm{Var}[\psi^2] = 2\rho^2\tau^4/((\rho-2)^2(\rho-4))` with :math:`\tau^2 =
    1/\sigma^2`, and :math:`\mathrm{E}[\psi] = \tau\sqrt{\rho/2}\,\Gamma(\tfrac{\rho-1}{2}) /
    \Gamma(\tfrac{\rho}{2})`. Needs :math:`\rho > 4`.
    """
    if not rho > 4.0:
        raise ValueError(f"rho must be > 4 for Var[psi^2] to exist, got rho={rho!r}")
    tau2 = 1.0 / (sigma * sigma)
    mean2 = rho * tau2 / (rho - 2.0)
    var2 = 2.0 * rho**2 * tau2**2 / ((rho - 2.0) ** 2 * (rho - 4.0))
    mean1 = math.sqrt(tau2 * rho / 2.0) * math.exp(math.lgamma((rho - 1.0) / 2.0) - math.lgamma(rho / 2.0))
    return {"mean_psi2": mean2, "var_psi2": var2, "mean_psi": mean1, "var_psi": mean2 - mean1**2}


def check_theorem2(
    ns: Iterable[int] = (1, 2, 5, 10, 50, 100),
    *,
    rho: float = 20.0,
    samples: int = 200_000,
    sigma: float = 1.0,
    seed: int = 0,
    chunk: int = 50_000,
) -> list[dict[str, float]]:
    r"""Monte Carlo check of :math:`\mathrm{Var}[\phi^2] / \mathrm{Var}[\psi^2] = 3/(n+2)`.

    Draws ``samples`` i.i.d. copies of :math:`\phi^2 = \sum_i w_i \psi_i^2` with
    :math:`\psi_i^2 = \rho/(\sigma^2\chi^2_\rho)` and :math:`w = X/\sum X`,
    :math:`X_i = \sigma^2\chi^2_1` (so :math:`w \sim \mathrm{Dirichlet}(\tfrac12)`), and
    divides the sample variance by the exact :math:`\mathrm{Var}[\psi^2]`.

    Row keys: ``n``, ``samples``, ``mc_ratio``, ``mc_se`` (standard error of ``mc_ratio``:
    :math:`\sqrt{(\hat\mu_4 - \hat s^4)/N} / \mathrm{Var}[\psi^2]`), ``formula`` (``3/(n+2)``),
    ``rel_error`` (``mc_ratio / formula - 1``), ``z`` (``(mc_ratio - formula) / mc_se``),
    ``mean_ratio`` (:math:`\hat{\mathrm{E}}[\phi^2]/\mathrm{E}[\psi^2]`, should be 1) and
    ``sqrt_ratio`` (:math:`\widehat{\mathrm{Var}}[\phi]/\mathrm{Var}[\psi]`, which the
    first-order step of the proof equates to ``formula``).
    """
    ns = _ranks(ns)
    samples = _positive_int("samples", samples)
    chunk = _positive_int("chunk", chunk)
    if samples < 2:
        raise ValueError(f"samples must be at least 2 to estimate a variance, got samples={samples}")
    exact = scale_inv_chi2_moments(rho, sigma)
    rng = np.random.default_rng([_seed(seed), 1])
    rows = []
    for n in ns:
        phi2 = np.empty(samples)
        for lo in range(0, samples, chunk):
            hi = min(lo + chunk, samples)
            psi2 = rho / (sigma * sigma * rng.chisquare(rho, size=(hi - lo, n)))
            x = rng.standard_normal((hi - lo, n))
            x *= x
            phi2[lo:hi] = (x * psi2).sum(axis=1) / x.sum(axis=1)
        centred = phi2 - phi2.mean()
        var = centred @ centred / (samples - 1)
        mu4 = np.mean(centred**4)
        se = math.sqrt(max(mu4 - var * var, 0.0) / samples)
        formula = 3.0 / (n + 2)
        ratio = var / exact["var_psi2"]
        ratio_se = se / exact["var_psi2"]
        rows.append({
            "n": n,
            "samples": samples,
            "mc_ratio": ratio,
            "mc_se": ratio_se,
            "formula": formula,
            "rel_error": ratio / formula - 1.0,
            "z": (ratio - formula) / ratio_se if ratio_se > 0 else 0.0,
            "mean_ratio": phi2.mean() / exact["mean_psi2"],
            "sqrt_ratio": np.sqrt(phi2).var(ddof=1) / exact["var_psi"],
        })
    return rows


def _step_columns(curves: VarianceCurves, wanted: Sequence[int]) -> list[int]:
    last = int(curves.steps[-1])
    return [t for t in wanted if t <= last] or [last]


def _infinite(rank: int, t: int, variant: str) -> bool:
    """Whether Var[phi] is infinite in population (E[psi^2] = E[1/v_hat] diverges)."""
    if variant == "past":  # E[phi^2] = E[1/v_hat_{t-1}], finite iff t - 1 > 2
        return t <= 3
    return (rank == 1 and t <= 2) or (t == 1 and rank <= 2)


#: The first step of the ratio panel: below it the rank-1 variance is infinite or unreliable.
SHOWN_FROM = 5


def _plot(curves: VarianceCurves, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.cm.viridis(np.linspace(0.0, 0.9, len(curves.ranks)))
    for k, (rank, color) in enumerate(zip(curves.ranks, colors)):
        left.plot(curves.steps, curves.var_adam[k], color=color, label=f"rank {rank}")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("training step t")
    left.set_ylabel(r"Var[$\phi$]")
    left.set_title(r"Var[$\phi$] of Fira's scaling factor (Adam $\psi$, $\beta_2$="
                   f"{curves.beta2})", fontsize=10)
    left.legend(fontsize=8)

    shown = curves.steps >= SHOWN_FROM
    ratio_adam, ratio_past = curves.ratio("adam"), curves.ratio("past")
    for k, (rank, color) in enumerate(zip(curves.ranks, colors)):
        if rank == 1:
            continue
        right.plot(curves.steps[shown], ratio_adam[k, shown], color=color, label=f"rank {rank}")
        right.plot(curves.steps[shown], ratio_past[k, shown], color=color, linestyle=":")
        right.axhline(3.0 / (rank + 2), color=color, linestyle="--", linewidth=0.8)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("training step t")
    right.set_ylabel(r"Var[$\phi$] / Var[$\psi$]")
    right.set_title("ratio to rank 1: solid Adam, dotted psi from past steps, "
                    "dashed 3/(n+2)", fontsize=9)
    right.legend(fontsize=8)
    plain_log_ticks(left.xaxis, right.xaxis)  # steps "5", "20": not "6 x 10^0" on a short run's minor ticks
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _fmt(x: float) -> str:
    return "nan" if not np.isfinite(x) else f"{x:.3g}"


def _report(curves: VarianceCurves, theorem: list[dict[str, float]], summary: dict[str, Any],
            *, rho: float, command: str | None, machine: str | None, seconds: float) -> str:
    cols = _step_columns(curves, REPORT_STEPS)
    lines = [
        f"# {TITLE}",
        "",
        f"- Date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Command: `{command}`" if command else "- Command: not recorded",
        f"- Machine: {machine}" if machine else "- Machine: not recorded",
        f"- Wall time: {seconds:.1f} s",
        f"- Simulation: {curves.samples} samples x {len(curves.steps)} steps, "
        f"ranks {list(curves.ranks)}, beta2 = {curves.beta2}, sigma = {curves.sigma}, "
        f"seed = {curves.seed} (numpy PCG64); theorem check: rho = {rho}, "
        f"{theorem[0]['samples']} samples per n.",
        "",
        "Setting: g ~ N(0, sigma^2) i.i.d. over the n = r entries of a column and over steps; "
        "psi_i = v_hat_{t,i}^(-1/2) with v_hat Adam's bias-corrected EMA of g^2; "
        "phi^2 = sum_i psi_i^2 g_i^2 / sum_i g_i^2 (the column-wise scaling factor with the "
        "first moment dropped, as in the theorem). Rank 1 gives phi = psi.",
        "",
        "## Var[phi] over training steps (Adam: psi from v_hat_t, current gradient included)",
        "",
        "| rank | " + " | ".join(f"t={t}" for t in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for k, rank in enumerate(curves.ranks):
        cells = []
        for t in cols:
            mark = "†" if _infinite(rank, t, "adam") else ""
            cells.append(_fmt(curves.var_adam[k, t - 1]) + mark)
        lines.append(f"| {rank} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "† population variance infinite (E[1/v_hat] diverges); the sample value only grows "
        "with the number of samples.",
        "",
        "## Var[phi_n] / Var[psi] against Theorem 2's 3/(n+2)",
        "",
        "`adam`: psi from v_hat_t (as Adam and Fira compute it). `past`: psi from v_hat_{t-1}, "
        "independent of the current weights w, the proof's assumption.",
        "",
    ]
    rcols = _step_columns(curves, RATIO_STEPS)
    lines += [
        "| rank | 3/(n+2) | " + " | ".join(f"adam t={t} | past t={t}" for t in rcols) + " |",
        "|---|---|" + "---|---|" * len(rcols),
    ]
    ratio_adam, ratio_past = curves.ratio("adam"), curves.ratio("past")
    for k, rank in enumerate(curves.ranks):
        cells = []
        for t in rcols:
            cells.append(_fmt(ratio_adam[k, t - 1]))
            cells.append(_fmt(ratio_past[k, t - 1]))
        lines.append(f"| {rank} | {3.0 / (rank + 2):.3g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Theorem 2 identity: Var[phi^2] = Var[psi^2] * 3/(n+2)",
        "",
        f"psi_i^2 ~ Scale-inv-chi^2(rho={rho}, 1/sigma^2) i.i.d., w ~ Dirichlet(1/2) from "
        "chi^2_1 draws, independent of psi. MC ratio = sample Var[phi^2] / exact Var[psi^2]; "
        "SE from the sample fourth moment.",
        "",
        "| n | MC Var[phi^2]/Var[psi^2] | MC s.e. | 3/(n+2) | rel. error | z | "
        "E[phi^2]/E[psi^2] | Var[phi]/Var[psi] (first order: 3/(n+2)) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in theorem:
        lines.append(
            f"| {row['n']} | {row['mc_ratio']:.4f} | {row['mc_se']:.4f} | {row['formula']:.4f} "
            f"| {row['rel_error']:+.2%} | {row['z']:+.2f} | {row['mean_ratio']:.4f} "
            f"| {row['sqrt_ratio']:.4f} |"
        )
    lines += ["", "## Paper vs measured", ""]
    lines += summary["findings"]
    lines += ["", "![Var[phi] against steps](variance.png)", ""]
    return "\n".join(lines)


def _loglog_slopes(curves: VarianceCurves, t_min: int = 10) -> dict[int, float]:
    """Slope of log Var[phi] against log t over ``t >= t_min`` (needs two or more points)."""
    keep = curves.steps >= t_min
    if keep.sum() < 2:
        return {}
    x = np.log(curves.steps[keep])
    return {r: float(np.polyfit(x, np.log(curves.var_adam[k, keep]), 1)[0])
            for k, r in enumerate(curves.ranks)}


def _summarise(curves: VarianceCurves, theorem: list[dict[str, float]]) -> dict[str, Any]:
    finite = curves.steps >= 3
    order_ok = np.all(np.diff(curves.var_adam[:, finite], axis=0) < 0, axis=0)
    violations = [int(t) for t in curves.steps[finite][~order_ok]]
    last = len(curves.steps) - 1
    ratio_adam, ratio_past = curves.ratio("adam"), curves.ratio("past")
    worst_z = max(abs(row["z"]) for row in theorem)
    early = {r: float(curves.var_adam[k, min(4, last)]) for k, r in enumerate(curves.ranks)}
    late = {r: float(curves.var_adam[k, last]) for k, r in enumerate(curves.ranks)}
    t_last = int(curves.steps[last])
    t_early = int(curves.steps[min(4, last)])
    slopes = _loglog_slopes(curves)
    findings = [
        "- Paper: Var[phi] decreases as the rank grows (rank 1 being Adam's psi), supporting "
        "Var[phi] <= Var[psi], and the variance is very large early in training.",
        f"- Measured: Var[phi] decreases strictly with rank at "
        f"{int(order_ok.sum())} of {int(finite.sum())} steps with t >= 3"
        + (f" (exceptions at t = {violations[:10]})" if violations else "")
        + f". At t = {t_early}: "
        + ", ".join(f"rank {r}: {_fmt(v)}" for r, v in early.items())
        + f"; at t = {t_last}: " + ", ".join(f"rank {r}: {_fmt(v)}" for r, v in late.items())
        + ".",
    ]
    if slopes:
        findings.append(
            "- Decay with t (least-squares slope of log Var[phi] on log t for t >= 10; "
            "-1 is a 1/t decay): "
            + ", ".join(f"rank {r}: {s:+.2f}" for r, s in slopes.items()) + ".")
    if len(curves.ranks) > 1 and curves.ranks[0] == 1:
        k = len(curves.ranks) - 1
        n = curves.ranks[k]
        formula = 3.0 / (n + 2)
        dev_adam = ratio_adam[k, last] / formula - 1.0
        dev_past = ratio_past[k, last] / formula - 1.0
        findings.append(
            f"- Size of the reduction at t = {t_last}: Var[phi_{n}]/Var[psi] = "
            f"{_fmt(ratio_adam[k, last])} with Adam's psi ({dev_adam:+.0%} from 3/(n+2) = "
            f"{formula:.3g}) and {_fmt(ratio_past[k, last])} with psi from past steps "
            f"({dev_past:+.0%}). Adam's v_hat_t contains the current gradient, so psi_i and "
            "w_i are dependent, which the proof assumes away; that dependence has weight "
            "about 1/t in v_hat_t.")
    findings.append(
        f"- Theorem 2's identity in Monte Carlo: the largest |z| over n = "
        f"{[row['n'] for row in theorem]} is {worst_z:.2f} (relative errors "
        + ", ".join(f"{row['rel_error']:+.2%}" for row in theorem) + "). The first-order "
        "step Var[phi]/Var[psi] ~ 3/(n+2) is off by "
        + ", ".join(f"{row['sqrt_ratio'] / row['formula'] - 1.0:+.1%}" for row in theorem)
        + " for the same n.")
    return {
        "decreasing_steps": int(order_ok.sum()),
        "checked_steps": int(finite.sum()),
        "violations": violations,
        "max_abs_z": worst_z,
        "findings": findings,
    }


def run_variance_analysis(
    out_dir: str | Path,
    *,
    ranks: Iterable[int] = DEFAULT_RANKS,
    samples: int = 10_000,
    steps: int = 1000,
    theorem_ns: Iterable[int] = (1, 2, 5, 10, 50, 100),
    theorem_samples: int | None = None,
    rho: float = 20.0,
    beta2: float = 0.999,
    seed: int = 0,
    command: str | None = None,
    machine: str | None = None,
) -> dict[str, Any]:
    """Run the simulation and the theorem check; write ``out_dir/report.md`` and
    ``out_dir/variance.png``.

    ``samples`` sets the simulation's Monte Carlo size; the theorem check uses
    ``theorem_samples`` (default ``20 * samples``: it is much cheaper per sample). Results
    depend only on the arguments (``seed`` fixes every draw); ``command`` and ``machine`` are
    copied into the report. Returns ``{"report", "figure", "curves", "theorem", "summary",
    "seconds"}``.
    """
    out = Path(out_dir)
    refuse_links(out)  # a folder from elsewhere: no link sends a write outside it
    refuse_other_commands_output(out)  # a sweep's folder before its report.md exists too
    check_report_owner(out, (f"# {TITLE}",), "analyze variance")
    _seed(seed)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < SHOWN_FROM:
        raise ValueError(f"steps must be an int >= {SHOWN_FROM} (--steps): the variance ratios are shown from "
                         f"t = {SHOWN_FROM}, where the rank-1 variance is finite; got steps={steps!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 2:
        raise ValueError(f"samples must be an int >= 2 (--samples) to estimate a variance, got samples={samples!r}")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    curves = simulate_scaling_variance(ranks, steps=steps, samples=samples, beta2=beta2, seed=seed)
    theorem = check_theorem2(
        theorem_ns,
        rho=rho,
        samples=theorem_samples if theorem_samples is not None else 20 * samples,
        seed=seed,
    )
    summary = _summarise(curves, theorem)
    figure = out / "variance.png"
    _plot(curves, figure)
    seconds = time.perf_counter() - start
    report = out / "report.md"
    write_text_atomic(report, _report(curves, theorem, summary, rho=rho, command=command,
                                      machine=machine, seconds=seconds))
    return {"report": report, "figure": figure, "curves": curves, "theorem": theorem,
            "summary": summary, "seconds": seconds}


__all__ = [
    "DEFAULT_RANKS",
    "VarianceCurves",
    "check_theorem2",
    "run_variance_analysis",
    "scale_inv_chi2_moments",
    "simulate_scaling_variance",
]
