r"""Fira's ablations: components, gradient stabilisers and the limiter's :math:`\gamma`.

Three tables of the paper from one set of runs (same initialisation and batches):

- the ablation table: ``fira``, ``fira-no-scaling`` (:math:`\phi = 1`), ``fira-matrix``
  (matrix-level :math:`\phi`), ``fira-no-limiter``, ``fira-clip`` (absolute norm clipping of
  :math:`S_t`), ``fira-shrink`` (gradient shrink), ``fira-tensorwise`` (tensor-wise scaling);
- the gradient-stabilisation table: the last four against ``fira``;
- the :math:`\gamma` table: :math:`\gamma = \infty` is ``fira-no-limiter`` and :math:`\gamma =
  1.01` is ``fira`` (its default), the other values are ``fira`` with the projected groups'
  ``gamma`` set by :class:`~fira_train.analysis.callbacks.GroupOptions` (runs ``fira-gamma<g>``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from fira_train.analysis.callbacks import set_options
from fira_train.analysis.runs import AnalysisRun, markdown_table, report_header, train_runs
from fira_train.config.run_config import RunConfig
from fira_train.files import write_text_atomic
from fira_train.methods.registry import get_method
from fira_train.report.plots import plot_curves

#: The heading of this analysis's report (train_runs refuses a folder whose report.md has another).
TITLE = "Ablations: norm-based scaling, limiter, gamma"

DEFAULT_VARIANTS = ("fira", "fira-no-scaling", "fira-matrix", "fira-no-limiter", "fira-clip",
                    "fira-shrink", "fira-tensorwise")
DEFAULT_GAMMAS = (math.inf, 1.1, 1.01, 1.001, 1.0)
FIRA_GAMMA = 1.01  # fira_optim's default, the paper's choice

#: The paper's validation perplexities (LLaMA 60M, C4, 10K steps).
PAPER_ABLATION = {"fira-no-scaling": 37.06, "fira-matrix": 31.52, "fira-no-limiter": 32.22,
                  "fira-clip": 31.22, "fira-shrink": 33.98, "fira-tensorwise": 33.81, "fira": 31.06}
PAPER_GAMMA = {math.inf: 32.22, 1.1: 32.09, 1.01: 31.06, 1.001: 31.26, 1.0: 31.28}
STABILISERS = ("fira", "fira-shrink", "fira-tensorwise", "fira-clip", "fira-no-limiter")
LABELS = {"fira": "Fira", "fira-no-scaling": "Fira-w.o.-scaling", "fira-matrix": "Fira-matrix",
          "fira-no-limiter": "Fira-w.o.-limiter", "fira-clip": "Fira-gradient-clipping",
          "fira-shrink": "Fira-gradient-shrink", "fira-tensorwise": "Fira-tensor-wise-scaling"}


def gamma_run_name(gamma: float) -> str:
    """The run that has limiter ratio ``gamma``."""
    if math.isinf(gamma):
        return "fira-no-limiter"
    if gamma == FIRA_GAMMA:
        return "fira"
    short = f"{gamma:g}"
    # every digit where 6 significant ones would round it: two gammas never share a run
    return f"fira-gamma{short if float(short) == gamma else repr(gamma)}"


def _check_gamma(gamma: Any) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or math.isnan(gamma) or gamma < 1:
        raise ValueError(f"gammas (--gammas) must be numbers >= 1 (inf for no limiter), got {gamma!r}")
    return float(gamma)


def ablation_runs(variants: Sequence[str], gammas: Sequence[float]) -> list[AnalysisRun]:
    names = list(dict.fromkeys([*variants, *(gamma_run_name(g) for g in gammas)]))
    runs = []
    for name in names:
        if name.startswith("fira-gamma"):
            gamma = float(name[len("fira-gamma"):])
            runs.append(AnalysisRun(name, "fira", callbacks=partial(set_options, gamma=gamma),
                                    describe=f"GroupOptions(gamma={gamma!r})"))
        else:
            runs.append(AnalysisRun(name, name))
    return runs


def _rank_note(measured: dict[str, float], paper: dict[Any, float], keys: Sequence[Any]) -> str:
    """Which key is best in each, and how many pairs are ordered the same way."""
    keys = [k for k in keys if k in measured and k in paper]
    if len(keys) < 2:
        return ""
    best_m = min(keys, key=lambda k: measured[k])
    best_p = min(keys, key=lambda k: paper[k])
    pairs = [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:]]
    same = sum((measured[a] - measured[b]) * (paper[a] - paper[b]) > 0 for a, b in pairs)
    return (f"Best: paper `{best_p}`, measured `{best_m}`. Pairs ordered as in the paper: "
            f"{same} of {len(pairs)}.")


def run_ablation(config: RunConfig, out_dir: str | Path, *, variants: Sequence[str] = DEFAULT_VARIANTS,
                 gammas: Sequence[float] = DEFAULT_GAMMAS, reuse: bool = False, overwrite: bool = False, jobs: int = 1,
                 command: str | None = None,
                 given: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Train the variants and the gamma runs; write ``OUT/report.md`` and ``OUT/ablation.png``."""
    for v in variants:
        get_method(v)
    gammas = [_check_gamma(g) for g in gammas]
    if config.optim.gamma != FIRA_GAMMA:  # every run but the gamma runs would take it, unlabelled
        raise ValueError(f"optim.gamma={config.optim.gamma!r}: the ablation compares limiter settings itself, "
                         f"each variant at the paper's gamma {FIRA_GAMMA} and the --gammas runs at theirs; "
                         "leave optim.gamma out and list the gammas in --gammas")
    out = Path(out_dir)
    runs = ablation_runs(variants, gammas)
    summaries = train_runs(config, runs, out, reuse=reuse, overwrite=overwrite, jobs=jobs, title=TITLE, given=given)
    ppl = {name: s["val_ppl"] for name, s in summaries.items()}

    figure = out / "ablation.png"
    plot_curves(out, [r.name for r in runs], figure)
    lines = report_header(TITLE, config, command=command)
    lines += [f"Final validation perplexity; learning rate {summaries[runs[0].name]['lr']:g}, "
              f"rank {config.optim.rank} (d_model {config.model.hidden_size}).", ""]
    if variants:
        lines += ["## Ablation table", "",
                  markdown_table(["method", "paper", "measured"],
                                 [[LABELS.get(v, v), PAPER_ABLATION.get(v, "-"), ppl[v]] for v in variants]),
                  "", _rank_note(ppl, PAPER_ABLATION, list(variants)), ""]
    stabilisers = [s for s in STABILISERS if s in ppl]
    if len(stabilisers) >= 2:
        lines += ["## Gradient stabilisation", "",
                  markdown_table(["", *(LABELS[s] for s in stabilisers)],
                                 [["paper", *(PAPER_ABLATION[s] for s in stabilisers)],
                                  ["measured", *(ppl[s] for s in stabilisers)]]),
                  "", _rank_note(ppl, PAPER_ABLATION, stabilisers), ""]
    if gammas:
        by_gamma = {g: ppl[gamma_run_name(g)] for g in gammas}
        lines += ["## Sensitivity to gamma", "",
                  markdown_table(["gamma", *("inf (no limiter)" if math.isinf(g) else f"{g:g}" for g in gammas)],
                                 [["paper", *(PAPER_GAMMA.get(g, "-") for g in gammas)],
                                  ["measured", *(by_gamma[g] for g in gammas)]]),
                  "", _rank_note(by_gamma, PAPER_GAMMA, gammas), ""]
    values = list(ppl.values())
    lines += [f"Spread of all measured perplexities: {100 * (max(values) / min(values) - 1):.1f}% "
              f"(min {min(values):.4g}, max {max(values):.4g}). One seed per run: differences of this size "
              "are not separated from seed-to-seed variation, which this analysis does not measure "
              "(rerun with `--seed` to see it).", "",
              "![training loss and validation perplexity](ablation.png)", ""]
    report = out / "report.md"
    write_text_atomic(report, "\n".join(lines) + "\n")
    return {"report": report, "figure": figure, "ppl": ppl, "summaries": summaries}
