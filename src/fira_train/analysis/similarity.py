r"""Similarity of low-rank and full-rank scaling factors (the paper's first table, Appendix D).

For a weight matrix with gradient :math:`G_t` and an adaptive optimizer's corrected gradient
:math:`\psi(\cdot)` (Adam: :math:`\hat m_t / (\sqrt{\hat v_t} + \epsilon)`), the scaling factor is

.. math::
    \phi_t = \frac{\|\psi(R_t)\|}{\|R_t\|}\ \text{(low rank, } R_t = P_t^\top G_t\text{)}, \qquad
    \phi_t = \frac{\|\psi(G_t)\|}{\|G_t\|}\ \text{(full rank)}

at the matrix level (one factor per matrix), and per column of :math:`R_t` / :math:`G_t` (the
dimension that is not projected; rows for a right projection) at the column level.

Two runs start from the same initialisation and see the same batches: Fira at rank ``r``
(``fira-r<r>``) and full-rank AdamW (``adamw``). :class:`ScalingFactorRecorder` records, every
``every`` steps after the optimizer step, the factors of every projected matrix -- for Fira from
its own state (:math:`R_t` from the stored basis and the step's gradient, :math:`N_t` from the
bias-corrected moments that step produced), for AdamW from its moments -- and ``columns``
columns per matrix sampled once with a fixed seed (the same columns in both runs).

At each recorded step the vectors of factors (over matrices, or over all sampled columns) of
the two runs are compared by cosine similarity, MSE, Euclidean distance and the Spearman,
Kendall and Pearson coefficients with their p-values (``scipy.stats``); the table averages
them over the recorded steps, the figure shows them over training.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

import fira_optim
from fira_optim.projection import project, projection_side, reduce_dim
from fira_optim.subspace import adam_bias_correction
from fira_train.analysis.rank_defaults import SIMILARITY_FRACTIONS, ranks_for_width
from fira_train.analysis.runs import (
    AnalysisRun,
    JsonlWriter,
    markdown_table,
    report_header,
    train_runs,
)
from fira_train.config.run_config import RunConfig
from fira_train.report.plots import pyplot
from fira_train.run.callbacks import TrainCallback
from fira_train.run.metrics import read_jsonl

FACTORS_FILE = "scaling_factors.jsonl"
FULL_RANK_RUN = "adamw"
METRICS = ("cosine", "mse", "rel_mse", "distance", "spearman", "kendall", "pearson")

#: The paper's LLaMA 60M row (rank 128, d_model 512: its main pre-training setup), averaged over 10K steps.
PAPER_60M = {
    "matrix": {"cosine": 0.9922, "mse": 3e-4, "spearman": (0.9972, 2e-62), "kendall": (0.9662, 7e-26),
               "pearson": (0.9891, 1e-46)},
    "column": {"cosine": 0.9273, "mse": 3e-5, "spearman": (0.9372, 0.0), "kendall": (0.7942, 0.0),
               "pearson": (0.8723, 0.0)},
}


def projected_matrices(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The matrices Fira projects (:func:`fira_optim.param_groups`), by parameter name."""
    chosen = {id(p) for g in fira_optim.param_groups(model, rank=1) if g.get("rank") is not None
              for p in g["params"]}
    return {name: p for name, p in model.named_parameters() if id(p) in chosen}


def sampled_columns(name: str, count: int, columns: int, seed: int) -> list[int]:
    """``columns`` of ``count`` indices (all if fewer), fixed by ``seed`` and the matrix name."""
    if count <= columns:
        return list(range(count))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return sorted(torch.randperm(count, generator=generator)[:columns].tolist())


def _factors(corrected: torch.Tensor, raw: torch.Tensor, dim: int) -> tuple[float, torch.Tensor]:
    """(||corrected|| / ||raw||, per-column ratios along the kept dimension)."""
    matrix = float(torch.linalg.vector_norm(corrected) / torch.linalg.vector_norm(raw))
    column = torch.linalg.vector_norm(corrected, dim=dim) / torch.linalg.vector_norm(raw, dim=dim)
    return matrix, column


@torch.no_grad()
def scaling_factors(name: str, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
                    ) -> tuple[float, torch.Tensor, str] | None:
    """(matrix factor, column factors, projection side) of one matrix after an Adam-type step.

    Fira state (a ``basis``): :math:`R = P^\\top G` (or :math:`G Q`) and
    :math:`N = \\frac{\\sqrt{1-\\beta_2^t}}{1-\\beta_1^t} \\frac{M}{\\sqrt{V} + \\epsilon}`
    (Algorithm 1). Full-rank Adam state: :math:`\\psi(G) = \\hat m / (\\sqrt{\\hat v} + \\epsilon)`
    (``torch.optim.Adam``'s form). None where the matrix has no such state or no gradient.
    """
    if p.grad is None or "exp_avg" not in state or "exp_avg_sq" not in state:
        return None
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    step = float(state["step"])
    grad = p.grad.float()
    m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
    if "basis" in state:
        side = projection_side(tuple(p.shape), group["proj_type"])
        raw = project(grad, state["basis"].float(), side)
        corrected = adam_bias_correction(int(step), beta1, beta2) * m / (v.sqrt() + eps)
    else:
        side = projection_side(tuple(p.shape), "std")
        raw = grad
        corrected = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps)
    matrix, column = _factors(corrected, raw, reduce_dim(side))
    return matrix, column, side


class ScalingFactorRecorder(TrainCallback):
    """Record the scaling factors of every projected matrix every ``every`` steps to ``path``.

    One JSON line per recorded step: ``{"step", "matrix": {name: phi}, "column": {name: [phi_i
    for the sampled columns]}}``.
    """

    def __init__(self, path: str | Path, *, every: int = 1, columns: int = 100, seed: int = 0) -> None:
        for arg, value in (("every", every), ("columns", columns)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {arg}={value!r}")
        self.writer = JsonlWriter(path)
        self.every, self.columns, self.seed = every, columns, seed
        self._indices: dict[str, list[int]] = {}

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loss: float) -> None:
        if step % self.every and step != 1:
            return
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        record: dict[str, Any] = {"step": step, "matrix": {}, "column": {}}
        for name, p in projected_matrices(model).items():
            if id(p) not in group_of:
                continue
            found = scaling_factors(name, p, optimizer.state.get(p, {}), group_of[id(p)])
            if found is None:
                continue
            matrix, column, _ = found
            if name not in self._indices:
                self._indices[name] = sampled_columns(name, column.numel(), self.columns, self.seed)
            record["matrix"][name] = matrix
            record["column"][name] = column[self._indices[name]].tolist()
        if record["matrix"]:
            self.writer.write(record)


# --------------------------------------------------------------------------- comparison


def similarity(low: np.ndarray, full: np.ndarray) -> dict[str, float]:
    """Cosine, MSE, relative MSE (MSE / mean(full^2)), Euclidean distance and (coefficient,
    p-value) of Spearman, Kendall and Pearson."""
    low, full = np.asarray(low, dtype=np.float64), np.asarray(full, dtype=np.float64)
    if low.shape != full.shape or low.ndim != 1 or low.size < 2:
        raise ValueError(f"need two 1-D vectors of the same length >= 2, got shapes {low.shape} and {full.shape}")
    out = {
        "cosine": float(low @ full / (np.linalg.norm(low) * np.linalg.norm(full))),
        "mse": float(np.mean((low - full) ** 2)),
        "rel_mse": float(np.mean((low - full) ** 2) / np.mean(full ** 2)),
        "distance": float(np.linalg.norm(low - full)),
    }
    for key, test in (("spearman", stats.spearmanr), ("kendall", stats.kendalltau), ("pearson", stats.pearsonr)):
        result = test(low, full)
        out[key], out[f"{key}_p"] = float(result[0]), float(result[1])
    return out


def compare_factors(low_records: list[dict[str, Any]], full_records: list[dict[str, Any]]
                    ) -> dict[str, list[dict[str, float]]]:
    """Per common step: ``{"matrix": [metrics with "step"], "column": [...]}``."""
    full_by_step = {r["step"]: r for r in full_records}
    out: dict[str, list[dict[str, float]]] = {"matrix": [], "column": []}
    for low in low_records:
        full = full_by_step.get(low["step"])
        if full is None:
            continue
        names = sorted(set(low["matrix"]) & set(full["matrix"]))
        if len(names) < 2:
            continue
        out["matrix"].append({"step": low["step"], **similarity(
            np.array([low["matrix"][n] for n in names]), np.array([full["matrix"][n] for n in names]))})
        a = np.concatenate([low["column"][n] for n in names])
        b = np.concatenate([full["column"][n] for n in names])
        out["column"].append({"step": low["step"], **similarity(a, b)})
    return out


def average(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Mean of every metric over the steps (NaNs, e.g. from constant vectors, left out), and the
    fraction of steps at which each coefficient had p < 0.05."""
    out: dict[str, float] = {"steps": float(len(per_step))}
    if not per_step:
        return out
    for key in per_step[0]:
        if key == "step":
            continue
        values = np.array([s[key] for s in per_step], dtype=np.float64)
        out[key] = float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
        if key.endswith("_p"):
            out[key.replace("_p", "_significant")] = float(np.mean(values < 0.05))
    return out


# --------------------------------------------------------------------------- the analysis


def record_factors(run_dir: Path, *, every: int, columns: int, seed: int) -> list[TrainCallback]:
    """A :class:`ScalingFactorRecorder` writing ``run_dir / FACTORS_FILE``."""
    return [ScalingFactorRecorder(run_dir / FACTORS_FILE, every=every, columns=columns, seed=seed)]


def similarity_runs(ranks: Sequence[int], *, every: int, columns: int, seed: int) -> list[AnalysisRun]:
    recorder = partial(record_factors, every=every, columns=columns, seed=seed)
    spec = f"ScalingFactorRecorder(every={every}, columns={columns}, seed={seed})"
    runs = [AnalysisRun(FULL_RANK_RUN, "adamw", callbacks=recorder, describe=spec)]
    runs += [AnalysisRun(f"fira-r{r}", "fira", (f"optim.rank={r}",), callbacks=recorder, describe=spec)
             for r in ranks]
    return runs


def _plot(results: dict[int, dict[str, list[dict[str, float]]]], d_model: int, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for (row, metric, label) in ((0, "cosine", "cosine similarity"), (1, "distance", "Euclidean distance")):
        for col, level in enumerate(("matrix", "column")):
            ax = axes[row][col]
            for rank, res in sorted(results.items()):
                steps = [s["step"] for s in res[level]]
                ax.plot(steps, [s[metric] for s in res[level]], label=f"r/d_model = {rank}/{d_model}",
                        linewidth=1.2)
            ax.set(title=f"{level} level: {label}", ylabel=label)
            if row == 1:
                ax.set(xlabel="step", yscale="log")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle("Low-rank (Fira) vs full-rank (AdamW) scaling factors over training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt_p(value: float) -> str:
    return f"{value:.1e}" if math.isfinite(value) else "nan"


def run_similarity(config: RunConfig, out_dir: str | Path, *, ranks: Sequence[int] | None = None,
                   every: int | None = None, columns: int = 100, reuse: bool = False,
                   overwrite: bool = False, jobs: int = 1, command: str | None = None) -> dict[str, Any]:
    """Train ``adamw`` and ``fira`` at each rank, compare their scaling factors, write
    ``OUT/report.md`` and ``OUT/similarity.png``. ``every`` defaults to ``steps // 100`` (>= 1),
    ``ranks`` to r/d_model = 16/256 and 128/256 of the config's d_model
    (:mod:`fira_train.analysis.rank_defaults`).
    """
    d_model = config.model.hidden_size
    if ranks is None:
        ranks = ranks_for_width(d_model, SIMILARITY_FRACTIONS)
    ranks = sorted(set(ranks))
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r < d_model:
            raise ValueError(f"ranks must be ints in [1, d_model={d_model}) to be projected, got {r!r}")
    every = every if every is not None else max(1, config.train.steps // 100)
    out = Path(out_dir)
    runs = similarity_runs(ranks, every=every, columns=columns, seed=config.train.seed)
    summaries = train_runs(config, runs, out, reuse=reuse, overwrite=overwrite, jobs=jobs)
    full = read_jsonl(out / FULL_RANK_RUN / FACTORS_FILE)
    results = {r: compare_factors(read_jsonl(out / f"fira-r{r}" / FACTORS_FILE), full) for r in ranks}
    averages = {r: {level: average(res[level]) for level in ("matrix", "column")} for r, res in results.items()}

    figure = out / "similarity.png"
    _plot(results, d_model, figure)
    matrices = len(full[0]["matrix"]) if full else 0
    sampled = sum(len(v) for v in full[0]["column"].values()) if full else 0
    lines = report_header("Similarity of low-rank and full-rank scaling factors", config, command=command)
    lines += [
        f"Runs (same initialisation and batches): `adamw` (full rank, lr {summaries[FULL_RANK_RUN]['lr']:g}) "
        f"and `fira` (lr {summaries[f'fira-r{ranks[0]}']['lr']:g}) at ranks {', '.join(map(str, ranks))} "
        f"(d_model {d_model}). Factors recorded after the optimizer step every {every} steps "
        f"(and at step 1) for the {matrices} projected matrices; column level: {columns} columns "
        f"sampled per matrix with seed {config.train.seed} ({sampled} columns in all). Values are "
        "averages over the recorded steps; p-values are averaged too, with the fraction of steps "
        "at which p < 0.05 in brackets.",
        "",
        "## Cosine similarity and MSE (the paper's first table)",
        "",
    ]
    rows = [["paper, LLaMA 60M (r = 128, d_model 512)", PAPER_60M["matrix"]["cosine"], PAPER_60M["matrix"]["mse"],
             "-", "-", PAPER_60M["column"]["cosine"], PAPER_60M["column"]["mse"], "-", "-"]]
    for r in ranks:
        a = averages[r]
        rows.append([f"measured, r/d_model = {r}/{d_model}"] + [
            a[level].get(k, math.nan) for level in ("matrix", "column")
            for k in ("cosine", "mse", "rel_mse", "distance")])
    lines.append(markdown_table(["", "matrix cosine", "matrix MSE", "matrix rel. MSE", "matrix distance",
                                 "column cosine", "column MSE", "column rel. MSE", "column distance"], rows))
    mean_phi = {level: float(np.mean([v for rec in full for vals in rec[level].values()
                                      for v in (vals if isinstance(vals, list) else [vals])]))
                for level in ("matrix", "column")} if full else {"matrix": math.nan, "column": math.nan}
    lines += ["", f"The paper does not say how its factors were normalised. Here they are raw: the full-rank "
              f"factors average {mean_phi['matrix']:.3g} (matrix) and {mean_phi['column']:.3g} (column), "
              "since phi ~ 1 / |gradient entry| and the gradients are small, so the raw MSE is not "
              "comparable with the paper's; the relative MSE (MSE / mean of the squared full-rank factors) "
              "and the scale-free cosine and rank correlations are. The relative MSE is large even where "
              "the cosine is high because the low-rank factors are systematically smaller: Adam's corrected "
              "entries are of order 1 early on, so ||psi(R)|| ~ sqrt(r n) while ||R|| ~ ||G|| (the top-r "
              "directions hold most of the gradient), i.e. about sqrt(r / d) times the full-rank factor (d the "
              "projected dimension); "
              "the two runs also follow different trajectories (different learning rates)."]
    lines += ["", "## Spearman, Kendall and Pearson coefficients (p-values) (Appendix D)", ""]
    header = [""] + [f"{level} {k}" for level in ("matrix", "column") for k in ("Spearman", "Kendall", "Pearson")]
    rows = [["paper, LLaMA 60M"] + [f"{PAPER_60M[level][k][0]:.4f} ({PAPER_60M[level][k][1]:.0e})"
                                     for level in ("matrix", "column") for k in ("spearman", "kendall", "pearson")]]
    for r in ranks:
        row = [f"measured, {r}/{d_model}"]
        for level in ("matrix", "column"):
            a = averages[r][level]
            for k in ("spearman", "kendall", "pearson"):
                row.append(f"{a.get(k, math.nan):.4f} ({_fmt_p(a.get(f'{k}_p', math.nan))}; "
                           f"{100 * a.get(f'{k}_significant', math.nan):.0f}%)")
        rows.append(row)
    lines.append(markdown_table(header, rows))
    trend = []
    for r in ranks:
        for level in ("matrix", "column"):
            series = [s["cosine"] for s in results[r][level]]
            if len(series) >= 4:
                q = max(1, len(series) // 4)
                trend.append([f"{r}/{d_model}", level, float(np.mean(series[:q])), float(np.mean(series[-q:]))])
    lines += ["", "## Trend over training", "",
              "Mean cosine similarity over the first and the last quarter of the recorded steps "
              "(the paper: fluctuations early, then a steady, high similarity; little loss at 16/256).", "",
              (markdown_table(["r/d_model", "level", "first quarter", "last quarter"], trend)
               if trend else "(too few steps)"),
              ""]
    findings = []
    for r in ranks:
        a = averages[r]
        findings.append(
            f"- r/d_model = {r}/{d_model}: cosine {a['matrix'].get('cosine', math.nan):.4f} (matrix) and "
            f"{a['column'].get('cosine', math.nan):.4f} (column) against the paper's 0.9922 and 0.9273; "
            f"Spearman {a['matrix'].get('spearman', math.nan):.4f} / {a['column'].get('spearman', math.nan):.4f} "
            f"against 0.9972 / 0.9372; p < 0.05 at {100 * a['matrix'].get('spearman_significant', math.nan):.0f}% "
            f"(matrix) and {100 * a['column'].get('spearman_significant', math.nan):.0f}% (column) of the steps.")
    if len(ranks) >= 2:
        lo, hi = ranks[0], ranks[-1]
        findings.append(
            f"- Lower rank: matrix cosine {averages[lo]['matrix'].get('cosine', math.nan):.4f} at {lo} vs "
            f"{averages[hi]['matrix'].get('cosine', math.nan):.4f} at {hi}, column "
            f"{averages[lo]['column'].get('cosine', math.nan):.4f} vs "
            f"{averages[hi]['column'].get('cosine', math.nan):.4f} "
            "(the paper: negligible reduction at 16/256).")
    lines += ["## Paper vs measured", "", *findings, "", "![similarity trends](similarity.png)", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return {"report": report, "figure": figure, "averages": averages, "per_step": results,
            "summaries": summaries}
