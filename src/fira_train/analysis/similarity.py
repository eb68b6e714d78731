r"""Similarity of low-rank and full-rank scaling factors (the paper's first table, Appendix D).

For a weight matrix with gradient :math:`G_t` and an adaptive optimizer's corrected gradient
:math:`\psi(\cdot)` (Adam: :math:`\hat m_t / (\sqrt{\hat v_t} + \epsilon)`), the scaling factor is

.. math::
    \phi_t = \frac{\|\psi(R_t)\|}{\|R_t\|}\ \text{(low rank, } R_t = P_t^\top G_t\text{)}, \qquad
    \phi_t = \frac{\|\psi(G_t)\|}{\|G_t\|}\ \text{(full rank)}

at the matrix level (one factor per matrix), and per column of :math:`R_t` / :math:`G_t` (the
dimension that is not projected; rows for a right projection) at the column level.

One Fira run per rank ``r`` (``fira-r<r>``). :class:`ScalingFactorRecorder` keeps, beside
Fira's own state, a *shadow* full-rank Adam: the first and second moments of every projected
matrix's full gradient, updated after every optimizer step with the gradient Fira just used
(same betas and eps; it never touches the weights). Every ``every`` steps it records both
factors of every projected matrix -- the low-rank one from Fira's state (:math:`R_t` from the
stored basis and the step's gradient, :math:`N_t` from the bias-corrected moments that step
produced) and the full-rank one from the shadow moments -- and ``columns`` columns per matrix
sampled once with a fixed seed. Both factors are thus computed on one trajectory (the same
weights, gradients and step): they differ in rank only, as the paper's low-rank and full-rank
runs do. (Training full-rank AdamW separately would also change the trajectory, and the
learning rate: 0.001 against Fira's 0.01.)

At each recorded step the vectors of factors (over matrices, or over all sampled columns) are
compared by cosine similarity, MSE, relative MSE, Euclidean distance and the Spearman, Kendall
and Pearson coefficients with their p-values (``scipy.stats``); the table averages them over
the recorded steps, the figure shows them over training. Null baselines (:func:`null_pairs`):
the same statistics between factors that should not agree -- each low-rank factor against the
full-rank factor of another matrix (matrices shuffled), of another sampled column anywhere
(columns shuffled), or of another column of the same matrix (columns shuffled within each
matrix: what the matrices' scales alone give). Factors are positive, so a cosine near 1 or a
relative MSE of 0.5 can arise without any pairing; only a value clearly beyond its null says
that the factors agree.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

import fira_optim
from fira_optim import precision
from fira_optim.projection import is_projected, project, projection_side, reduce_dim
from fira_optim.subspace import adam_bias_correction
from fira_train.analysis.rank_defaults import SIMILARITY_FRACTIONS, ranks_for_width
from fira_train.analysis.runs import (
    AnalysisRun,
    JsonlWriter,
    markdown_table,
    read_records,
    refuse_step_in_backward,
    report_header,
    train_runs,
)
from fira_train.config.run_config import RunConfig
from fira_train.files import write_text_atomic
from fira_train.report.plots import pyplot, save_figure
from fira_train.run.callbacks import TrainCallback

#: The heading of this analysis's report (train_runs refuses a folder whose report.md has another).
TITLE = "Similarity of low-rank and full-rank scaling factors"

FACTORS_FILE = "scaling_factors.jsonl"
METRICS = ("cosine", "mse", "rel_mse", "distance", "spearman", "kendall", "pearson")

#: The paper's LLaMA 60M row (rank 128 on the 60M model of its main pre-training setup, whose d_model is
#: 512 though its Table 1 prints r/d_model as 128/256), averaged over 10K steps.
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


def adam_factors(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float,
                 betas: tuple[float, float], eps: float, side: str) -> tuple[float, torch.Tensor]:
    r"""Full-rank Adam's factors: :math:`\psi(G) = \hat m / (\sqrt{\hat v} + \epsilon)`
    (``torch.optim.Adam``'s form) against ``grad``, columns along ``side``'s kept dimension."""
    beta1, beta2 = betas
    m, v = exp_avg.float(), exp_avg_sq.float()
    corrected = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps)
    return _factors(corrected, grad.float(), reduce_dim(side))


@torch.no_grad()
def scaling_factors(name: str, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
                    ) -> tuple[float, torch.Tensor, str] | None:
    """(matrix factor, column factors, projection side) of one matrix after an Adam-type step.

    Fira state (a ``basis``): :math:`R = P^\\top G` (or :math:`G Q`) and
    :math:`N = \\frac{\\sqrt{1-\\beta_2^t}}{1-\\beta_1^t} \\frac{M}{\\sqrt{V} + \\epsilon}`
    (Algorithm 1), the moments decoded as the optimizer decodes them (int8, bf16). Full-rank
    Adam state: :func:`adam_factors`. None where the matrix has no such state, no gradient, or
    no update yet. A column whose ``R`` (or ``G``) is zero has no factor (0 / 0: NaN).
    """
    if p.grad is None or "exp_avg" not in state or "exp_avg_sq" not in state:
        return None
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    step = float(state["step"])
    if step == 0:  # no update yet (a first gradient that was all zero): the moments are zeros
        return None
    grad = p.grad.float()
    # int8 moments are codes with per-block scales (bf16 ones a cast): read through the
    # optimizer's own decoding, the values its update used
    moments = precision.decode(state, ("exp_avg", "exp_avg_sq"), torch.float32)
    m, v = moments["exp_avg"], moments["exp_avg_sq"]
    if "basis" not in state:
        side = projection_side(tuple(p.shape), "std")
        matrix, column = adam_factors(grad, m, v, step, (beta1, beta2), eps, side)
        return matrix, column, side
    side = projection_side(tuple(p.shape), group["proj_type"])
    raw = project(grad, state["basis"].float(), side)
    corrected = adam_bias_correction(int(step), beta1, beta2) * m / (v.sqrt() + eps)
    matrix, column = _factors(corrected, raw, reduce_dim(side))
    return matrix, column, side


class ShadowAdam:
    """Full-rank Adam moments of some matrices, fed the gradients another optimizer used.

    :meth:`update` after each optimizer step (a matrix without a gradient is skipped, as
    ``torch.optim.Adam`` skips it); :meth:`factors` gives what full-rank Adam's factors would be
    at that step. Nothing is written to the weights.
    """

    def __init__(self) -> None:
        self.state: dict[str, dict[str, Any]] = {}

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{name: {"step", "exp_avg", "exp_avg_sq"}}`` (the tensors themselves: a checkpoint
        copies them when it is written)."""
        return {name: dict(state) for name, state in self.state.items()}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        for name, moments in state.items():
            if set(moments) != {"step", "exp_avg", "exp_avg_sq"}:
                raise ValueError(f"shadow Adam state of {name!r} holds {sorted(moments)}, not step, exp_avg "
                                 "and exp_avg_sq")
        self.state = {name: {"step": int(m["step"]), "exp_avg": m["exp_avg"].clone(),
                             "exp_avg_sq": m["exp_avg_sq"].clone()} for name, m in state.items()}

    @torch.no_grad()
    def update(self, name: str, grad: torch.Tensor, betas: tuple[float, float]) -> None:
        beta1, beta2 = betas
        g = grad.float()
        state = self.state.get(name)
        if state is None:
            state = self.state[name] = {"step": 0, "exp_avg": torch.zeros_like(g), "exp_avg_sq": torch.zeros_like(g)}
        _to_device(state, g.device)
        state["step"] += 1
        state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)

    @torch.no_grad()
    def factors(self, name: str, grad: torch.Tensor, betas: tuple[float, float], eps: float,
                side: str) -> tuple[float, torch.Tensor] | None:
        state = self.state.get(name)
        if state is None:
            return None
        _to_device(state, grad.device)
        return adam_factors(grad, state["exp_avg"], state["exp_avg_sq"], float(state["step"]), betas, eps, side)


def _to_device(state: dict[str, Any], device: torch.device) -> None:
    """Moments loaded from a checkpoint (on the CPU) follow the gradients of a GPU run."""
    for key in ("exp_avg", "exp_avg_sq"):
        if state[key].device != device:
            state[key] = state[key].to(device)


class ScalingFactorRecorder(TrainCallback):
    """Record the scaling factors of every projected matrix every ``every`` steps to ``path``.

    One JSON line per recorded step: ``{"step", "matrix": {name: phi}, "column": {name: [phi_i
    for the sampled columns]}}`` from the optimizer's own state. With ``shadow=True`` (a Fira
    run), a :class:`ShadowAdam` is fed every step's gradients, and each line also holds
    ``"full_matrix"`` and ``"full_column"``: full-rank Adam's factors on the same gradients, over
    the same columns (those of the side Fira projects).
    """

    def __init__(self, path: str | Path, *, every: int = 1, columns: int = 100, seed: int = 0,
                 shadow: bool = False) -> None:
        for arg, value in (("every", every), ("columns", columns)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {arg}={value!r}")
        self.writer = JsonlWriter(path)
        self.every, self.columns, self.seed = every, columns, seed
        self.shadow = ShadowAdam() if shadow else None
        self._indices: dict[str, list[int]] = {}  # a function of (name, seed): rebuilt on resume

    def begin(self, step: int) -> None:
        self.writer.begin(step)

    def state_dict(self) -> dict[str, Any]:
        """The shadow Adam's moments (none without ``shadow``)."""
        return {} if self.shadow is None else {"shadow": self.shadow.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = set() if self.shadow is None else {"shadow"}
        if set(state) != expected:
            raise ValueError(f"ScalingFactorRecorder(shadow={self.shadow is not None})'s state holds "
                             f"{sorted(state)}, not {sorted(expected)}: the checkpoint was written with "
                             "other callbacks")
        if self.shadow is not None:
            self.shadow.load_state_dict(state["shadow"])

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loss: float) -> None:
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        # those the run projects: at a rank >= min(m, n) (a GQA k_proj / v_proj at a high rank) Fira
        # trains a matrix as plain Adam, whose factors would equal the shadow's exactly
        matrices = {name: p for name, p in projected_matrices(model).items()
                    if id(p) in group_of and ("rank" not in group_of[id(p)] or is_projected(p, group_of[id(p)]))}
        if self.shadow is not None:  # every step, recorded or not: the moments see every gradient
            for name, p in matrices.items():
                if p.grad is not None:
                    self.shadow.update(name, p.grad, group_of[id(p)]["betas"])
        if step % self.every and step != 1:
            return
        record: dict[str, Any] = {"step": step, "matrix": {}, "column": {}}
        if self.shadow is not None:
            record.update(full_matrix={}, full_column={})
        for name, p in matrices.items():
            group = group_of[id(p)]
            found = scaling_factors(name, p, optimizer.state.get(p, {}), group)
            if found is None:
                continue
            matrix, column, side = found
            if name not in self._indices:
                self._indices[name] = sampled_columns(name, column.numel(), self.columns, self.seed)
            index = self._indices[name]
            if self.shadow is not None:
                full = self.shadow.factors(name, p.grad, group["betas"], group["eps"], side)
                if full is None:
                    continue
                record["full_matrix"][name] = full[0]
                record["full_column"][name] = full[1][index].tolist()
            record["matrix"][name] = matrix
            record["column"][name] = column[index].tolist()
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


NULLS = {
    "matrix": ("null_matrix",),
    "column": ("null_column", "null_column_within"),
}
"""The null baselines of each level (:func:`null_pairs`)."""

NULL_LABELS = {
    "null_matrix": "matrices shuffled",
    "null_column": "columns shuffled",
    "null_column_within": "columns shuffled within each matrix",
}


def null_pairs(low: dict[str, Any], full: dict[str, Any], names: Sequence[str],
               rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Pairs of factor vectors that should not agree, from one step's low- and full-rank factors
    (``low`` / ``full``: ``{"matrix": {name: phi}, "column": {name: [phi_i]}}``):

    - ``null_matrix``: each matrix's low-rank factor against the full-rank factor of a matrix
      drawn by a random permutation (the pairing broken, the distribution kept);
    - ``null_column``: the sampled columns' low-rank factors against a random permutation of
      all sampled full-rank column factors;
    - ``null_column_within``: the same, with each matrix's columns permuted among themselves
      (each column still meets its own matrix's scale).
    """
    low_matrix = np.array([low["matrix"][n] for n in names], dtype=np.float64)
    full_matrix = np.array([full["matrix"][n] for n in names], dtype=np.float64)
    low_column = np.concatenate([np.asarray(low["column"][n], dtype=np.float64) for n in names])
    full_column = np.concatenate([np.asarray(full["column"][n], dtype=np.float64) for n in names])
    within = np.concatenate([rng.permutation(np.asarray(full["column"][n], dtype=np.float64)) for n in names])
    return {"null_matrix": (low_matrix, rng.permutation(full_matrix)),
            "null_column": (low_column, rng.permutation(full_column)),
            "null_column_within": (low_column, within)}


def compare_factors(records: list[dict[str, Any]], *, seed: int = 0) -> dict[str, list[dict[str, float]]]:
    """Per recorded step (records of a :class:`ScalingFactorRecorder` with ``shadow=True``):
    ``{"matrix": [metrics with "step"], "column": [...], "null_matrix": [...], "null_column":
    [...], "null_column_within": [...]}``. The null permutations are drawn from ``seed`` and the
    step, so a report is reproducible."""
    out: dict[str, list[dict[str, float]]] = {key: [] for key in ("matrix", "column", *NULL_LABELS)}
    for record in records:
        if "full_matrix" not in record:
            raise ValueError("the records hold no full-rank factors: they were written without the shadow "
                             "Adam moments (ScalingFactorRecorder(shadow=True)); rerun the analysis")
        low, full = _defined(record)
        names = sorted(set(low["matrix"]) & set(full["matrix"]))
        if len(names) < 2:
            continue
        step = record["step"]
        out["matrix"].append({"step": step, **similarity(
            np.array([low["matrix"][n] for n in names]), np.array([full["matrix"][n] for n in names]))})
        a = np.concatenate([low["column"][n] for n in names])
        b = np.concatenate([full["column"][n] for n in names])
        out["column"].append({"step": step, **similarity(a, b)})
        rng = np.random.default_rng([seed, step])
        for key, (x, y) in null_pairs(low, full, names, rng).items():
            out[key].append({"step": step, **similarity(x, y)})
    return out


def _defined(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One record's low- and full-rank factors (``{"matrix": {name: phi}, "column": {name:
    [phi_i]}}``) where both are defined: a matrix or column with a zero gradient has none (0 / 0,
    recorded as null), and is left out of the step's comparison on both sides."""
    def finite(value: Any) -> bool:
        return value is not None and math.isfinite(value)

    low: dict[str, Any] = {"matrix": {}, "column": {}}
    full: dict[str, Any] = {"matrix": {}, "column": {}}
    for name in set(record["matrix"]) & set(record["full_matrix"]):
        if not (finite(record["matrix"][name]) and finite(record["full_matrix"][name])):
            continue
        pairs = [(a, b) for a, b in zip(record["column"][name], record["full_column"][name])
                 if finite(a) and finite(b)]
        if not pairs:
            continue
        low["matrix"][name], full["matrix"][name] = record["matrix"][name], record["full_matrix"][name]
        low["column"][name], full["column"][name] = [a for a, _ in pairs], [b for _, b in pairs]
    return low, full


def average(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Mean of every metric over the steps (NaNs, e.g. from constant vectors, left out), and the
    fraction of steps at which each coefficient had p < 0.05 (of the steps where it had a p-value)."""
    out: dict[str, float] = {"steps": float(len(per_step))}
    if not per_step:
        return out
    for key in per_step[0]:
        if key == "step":
            continue
        values = np.array([s[key] for s in per_step], dtype=np.float64)
        out[key] = float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
        if key.endswith("_p"):
            tested = values[np.isfinite(values)]
            out[key.replace("_p", "_significant")] = float(np.mean(tested < 0.05)) if tested.size else math.nan
    return out


# --------------------------------------------------------------------------- the analysis


def record_factors(run_dir: Path, *, every: int, columns: int, seed: int) -> list[TrainCallback]:
    """A :class:`ScalingFactorRecorder` with the shadow Adam moments, writing ``run_dir / FACTORS_FILE``."""
    return [ScalingFactorRecorder(run_dir / FACTORS_FILE, every=every, columns=columns, seed=seed, shadow=True)]


def similarity_runs(ranks: Sequence[int], *, every: int, columns: int, seed: int) -> list[AnalysisRun]:
    """One Fira run per rank; each records its own low-rank factors and the shadow full-rank ones."""
    recorder = partial(record_factors, every=every, columns=columns, seed=seed)
    spec = f"ScalingFactorRecorder(every={every}, columns={columns}, seed={seed}, shadow=True)"
    return [AnalysisRun(f"fira-r{r}", "fira", (f"optim.rank={r}",), callbacks=recorder, describe=spec)
            for r in ranks]


def _plot(results: dict[int, dict[str, list[dict[str, float]]]], d_model: int, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for (row, metric, label) in ((0, "cosine", "cosine similarity"), (1, "rel_mse", "relative MSE")):
        for col, level in enumerate(("matrix", "column")):
            ax = axes[row][col]
            for rank, res in sorted(results.items()):
                steps = [s["step"] for s in res[level]]
                line, = ax.plot(steps, [s[metric] for s in res[level]], label=f"r/d_model = {rank}/{d_model}",
                                linewidth=1.2)
                null = NULLS[level][0]
                ax.plot([s["step"] for s in res[null]], [s[metric] for s in res[null]], linestyle="--",
                        linewidth=0.9, color=line.get_color(), label=f"{rank}/{d_model}, null ({NULL_LABELS[null]})")
            ax.set(title=f"{level} level: {label}", ylabel=label)
            if row == 1:
                ax.set(xlabel="step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Low-rank (Fira) vs full-rank (shadow Adam, same run) scaling factors over training")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _fmt_p(value: float) -> str:
    return f"{value:.1e}" if math.isfinite(value) else "nan"


def _mean_factor(records: list[dict[str, Any]], key: str) -> float:
    """The mean of the recorded factors that are finite numbers: one that could not be computed
    (0 / 0 for a zero gradient column, recorded as NaN, null once in JSON; or infinite) made the
    report's mean, and its low/full ratio, NaN. Each side's mean is over its own finite factors
    (the per-step statistics drop a pair where either side is not finite)."""
    values = [v for rec in records for vals in rec[key].values() for v in (vals if isinstance(vals, list) else [vals])]
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def run_similarity(config: RunConfig, out_dir: str | Path, *, ranks: Sequence[int] | None = None,
                   every: int | None = None, columns: int = 100, reuse: bool = False,
                   overwrite: bool = False, jobs: int = 1, command: str | None = None,
                   given: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Train ``fira`` at each rank, recording its low-rank factors and the shadow full-rank Adam
    factors on the same gradients; compare them, with the null baselines beside; write
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
            raise ValueError(f"ranks (--ranks) must be ints in [1, d_model={d_model}) to be projected, got {r!r}")
    refuse_step_in_backward(config, "reads each step's gradients after the step")
    every = every if every is not None else max(1, config.train.steps // 100)
    for flag, value in (("--every", every), ("--columns", columns)):  # before any run folder is made
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be an int >= 1, got {value!r}")
    out = Path(out_dir)
    seed = config.train.seed
    runs = similarity_runs(ranks, every=every, columns=columns, seed=seed)
    summaries = train_runs(config, runs, out, reuse=reuse, overwrite=overwrite, jobs=jobs, title=TITLE, given=given)
    records = {r: read_records(out / f"fira-r{r}" / FACTORS_FILE) for r in ranks}
    results = {r: compare_factors(records[r], seed=seed) for r in ranks}
    keys = ("matrix", "column", *NULL_LABELS)
    averages = {r: {key: average(res[key]) for key in keys} for r, res in results.items()}

    figure = out / "similarity.png"
    _plot(results, d_model, figure)
    # what each run compared: every matrix it recorded (at a rank >= a matrix's smaller side Fira
    # trains it as plain Adam, and it is left out), with its sampled columns
    counts = {}
    for r in ranks:
        columns_of = {name: len(values) for record in records[r] for name, values in record["column"].items()}
        counts[r] = (len(columns_of), sum(columns_of.values()))
    left_out = "a matrix whose smaller side is at most the rank is trained as plain Adam and left out"
    if len(set(counts.values())) == 1:
        matrices = f"the {counts[ranks[0]][0]} projected matrices ({left_out})"
        sampled = f"{counts[ranks[0]][1]} columns in all"
    else:
        matrices = f"the projected matrices ({', '.join(f'{counts[r][0]} at r = {r}' for r in ranks)}; {left_out})"
        sampled = f"columns in all: {', '.join(f'{counts[r][1]} at r = {r}' for r in ranks)}"
    # the steps the averages are over: a run shorter than --every records step 1 alone
    recorded = [record["step"] for record in records[ranks[0]]]
    at_steps = (f"step{'s' * (len(recorded) > 1)} {', '.join(map(str, recorded))}" if len(recorded) <= 5 else
                f"{len(recorded)} steps, {recorded[0]} to {recorded[-1]}")
    lr = summaries[f"fira-r{ranks[0]}"]["lr"]
    lines = report_header(TITLE, config, command=command)
    lines += [
        f"Runs: `fira` (lr {lr:g}) at ranks {', '.join(map(str, ranks))} (d_model {d_model}). In each run the "
        "full-rank factors come from Adam moments kept beside Fira's state and fed the gradients Fira used "
        "(a shadow Adam with the same betas and eps, which never updates the weights): the low-rank and "
        "full-rank factors are computed at the same weights, gradients and step, and differ only in rank. "
        f"Factors recorded after the optimizer step every {every} steps and at step 1 ({at_steps}) for {matrices}; "
        f"column level: {columns} columns sampled per matrix with seed {seed} ({sampled}). Values are averages over the recorded steps; p-values are averaged too, "
        "with the fraction of steps at which p < 0.05 in brackets.",
        "",
        "Null baselines (rows marked *null*): the same statistics between factors that should not agree: "
        "each low-rank factor against the full-rank factor of another matrix (matrices shuffled), of another "
        "sampled column (columns shuffled), or of another column of the same matrix (columns shuffled within "
        "each matrix: what the matrices' scales alone give); one random permutation per recorded step, "
        f"seed {seed}. The factors are all positive, so a high cosine or a moderate relative MSE appears "
        "without any pairing: a measured value says the factors agree only as far as it is beyond its null.",
        "",
        "## Cosine similarity and MSE (the paper's first table)",
        "",
    ]
    paper = "paper, LLaMA 60M (r = 128, d_model 512; printed 128/256 in its Table 1)"
    rows = [[paper, PAPER_60M["matrix"]["cosine"], PAPER_60M["matrix"]["mse"],
             "-", "-", PAPER_60M["column"]["cosine"], PAPER_60M["column"]["mse"], "-", "-"]]
    metric_keys = ("cosine", "mse", "rel_mse", "distance")
    for r in ranks:
        a = averages[r]
        rows.append([f"measured, r/d_model = {r}/{d_model}"]
                    + [a[level].get(k, math.nan) for level in ("matrix", "column") for k in metric_keys])
        rows.append([f"null, {r}/{d_model}: matrices / columns shuffled"]
                    + [a[key].get(k, math.nan) for key in ("null_matrix", "null_column") for k in metric_keys])
        rows.append([f"null, {r}/{d_model}: columns shuffled within each matrix"]
                    + ["-"] * 4 + [a["null_column_within"].get(k, math.nan) for k in metric_keys])
    lines.append(markdown_table(["", "matrix cosine", "matrix MSE", "matrix rel. MSE", "matrix distance",
                                 "column cosine", "column MSE", "column rel. MSE", "column distance"], rows))
    scale = "; ".join(
        f"r = {r}: full-rank {_mean_factor(records[r], 'full_matrix'):.3g} (matrix) and "
        f"{_mean_factor(records[r], 'full_column'):.3g} (column), low-rank / full-rank "
        f"{_mean_factor(records[r], 'matrix') / _mean_factor(records[r], 'full_matrix'):.3g} (matrix) and "
        f"{_mean_factor(records[r], 'column') / _mean_factor(records[r], 'full_column'):.3g} (column)"
        for r in ranks)
    lines += ["", "The paper does not say how its factors were normalised. Here they are raw (mean factors: "
              f"{scale}), since phi ~ 1 / |gradient entry| and the gradients are small, so the raw MSE is not "
              "comparable with the paper's; the relative MSE (MSE / mean of the squared full-rank factors) "
              "and the scale-free cosine and rank correlations are. The relative MSE is large even where "
              "the cosine is high because the low-rank factors are systematically smaller: Adam's corrected "
              "entries are of order 1 early on, so ||psi(R)|| ~ sqrt(r n) while ||R|| ~ ||G|| (the top-r "
              "directions hold most of the gradient), i.e. about sqrt(r / d) times the full-rank factor (d the "
              "projected dimension)."]
    lines += ["", "## Spearman, Kendall and Pearson coefficients (p-values) (Appendix D)", ""]
    header = [""] + [f"{level} {k}" for level in ("matrix", "column") for k in ("Spearman", "Kendall", "Pearson")]
    rows = [["paper, LLaMA 60M"] + [f"{PAPER_60M[level][k][0]:.4f} ({PAPER_60M[level][k][1]:.0e})"
                                     for level in ("matrix", "column") for k in ("spearman", "kendall", "pearson")]]

    def coefficients(a: dict[str, float]) -> list[str]:
        return [f"{a.get(k, math.nan):.4f} ({_fmt_p(a.get(f'{k}_p', math.nan))}; "
                f"{100 * a.get(f'{k}_significant', math.nan):.0f}%)" for k in ("spearman", "kendall", "pearson")]

    for r in ranks:
        a = averages[r]
        rows.append([f"measured, {r}/{d_model}"] + coefficients(a["matrix"]) + coefficients(a["column"]))
        rows.append([f"null, {r}/{d_model}: matrices / columns shuffled"]
                    + coefficients(a["null_matrix"]) + coefficients(a["null_column"]))
        rows.append([f"null, {r}/{d_model}: columns shuffled within each matrix"]
                    + ["-"] * 3 + coefficients(a["null_column_within"]))
    lines.append(markdown_table(header, rows))
    trend = []
    for r in ranks:
        for key, label in (("matrix", "matrix"), ("null_matrix", "matrix, null"),
                           ("column", "column"), ("null_column", "column, null"),
                           ("null_column_within", "column, null within matrices")):
            series = [s["cosine"] for s in results[r][key]]
            if len(series) >= 4:
                q = max(1, len(series) // 4)
                trend.append([f"{r}/{d_model}", label, float(np.mean(series[:q])), float(np.mean(series[-q:]))])
    lines += ["", "## Trend over training", "",
              "Mean cosine similarity over the first and the last quarter of the recorded steps "
              "(the paper: fluctuations early, then a steady, high similarity; little loss at 16/256).", "",
              (markdown_table(["r/d_model", "level", "first quarter", "last quarter"], trend)
               if trend else "(too few steps)"),
              ""]
    findings = []
    for r in ranks:
        a = averages[r]

        def value(key: str, metric: str, digits: str = ".4f", a: dict = a) -> str:
            return f"{a[key].get(metric, math.nan):{digits}}"

        findings.append(
            f"- r/d_model = {r}/{d_model}: cosine {value('matrix', 'cosine')} (matrix; null "
            f"{value('null_matrix', 'cosine')}) and {value('column', 'cosine')} (column; null "
            f"{value('null_column', 'cosine')}, within matrices {value('null_column_within', 'cosine')}) "
            "against the paper's 0.9922 and 0.9273; relative MSE "
            f"{value('matrix', 'rel_mse', '.3g')} (null {value('null_matrix', 'rel_mse', '.3g')}) and "
            f"{value('column', 'rel_mse', '.3g')} (null {value('null_column', 'rel_mse', '.3g')}); Spearman "
            f"{value('matrix', 'spearman')} / {value('column', 'spearman')} (null "
            f"{value('null_matrix', 'spearman')} / {value('null_column', 'spearman')}) against 0.9972 / 0.9372; "
            f"p < 0.05 at {100 * a['matrix'].get('spearman_significant', math.nan):.0f}% (matrix) and "
            f"{100 * a['column'].get('spearman_significant', math.nan):.0f}% (column) of the steps.")
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
    write_text_atomic(report, "\n".join(lines) + "\n")
    return {"report": report, "figure": figure, "averages": averages, "per_step": results,
            "summaries": summaries}
