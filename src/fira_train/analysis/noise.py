r"""Robustness of norm-based scaling to gradient noise (the paper's noise table).

Four runs from the same initialisation and batches: ``fira-only-scaling``
(:math:`W \mathrel{-}= \eta\,\phi_t(R_t)\,G_t`, column-wise factors from the low-rank Adam) and
full-rank ``adamw``, each without noise and with :math:`G \leftarrow G + s\,\mathcal{N}(0, 1)` added
to every gradient entry before the step (:class:`~fira_train.analysis.callbacks.GradientNoise`,
:math:`s = 10^{-5}` as in the paper). The paper's argument: a factor shared by a column averages
the noise over many entries, while Adam's element-wise :math:`1/\sqrt{\hat v}` amplifies it
wherever the true gradient is small.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import fira_optim
from fira_train.analysis.callbacks import NORMS_FILE, GradientNoise, record_norms, record_norms_with_noise
from fira_train.analysis.runs import (AnalysisRun, markdown_table, read_step_records,
                                      refuse_step_in_backward, report_header, train_runs)
from fira_train.config.run_config import RunConfig
from fira_train.files import write_text_atomic
from fira_train.methods.registry import get_method
from fira_train.report.plots import plain_log_ticks, pyplot, save_figure
from fira_train.run.metrics import read_metrics

#: The heading of this analysis's report (train_runs refuses a folder whose report.md has another).
TITLE = "Robustness to gradient noise"

DEFAULT_METHODS = ("fira-only-scaling", "adamw")
DEFAULT_SCALE = 1e-5
#: Validation perplexity (LLaMA 60M, C4, 10K steps): without noise, with noise 1e-5 N(0, 1).
PAPER = {"fira-only-scaling": (31.68, 34.64), "adamw": (34.06, 445.47)}


def noisy_name(method: str) -> str:
    return f"{method}-noise"


def noise_runs(methods: Sequence[str], scale: float, seed: int) -> list[AnalysisRun]:
    """Each method clean and noisy; both record the raw gradient norm (before the noise)."""
    runs = []
    for m in methods:
        runs.append(AnalysisRun(m, m, callbacks=record_norms,
                                describe="NormRecorder"))
        runs.append(AnalysisRun(
            noisy_name(m), m, callbacks=partial(record_norms_with_noise, scale=scale, seed=seed),
            # "noise seed derived": not the runs drawn from the seed itself, before noise_seed
            describe=f"NormRecorder, GradientNoise(scale={scale!r}, seed={seed}, noise seed derived)"))
    return runs


def gradient_rms(run_dir: Path, summary: Mapping[str, Any]) -> float:
    """Root-mean-square gradient entry of the finished run in ``run_dir`` (its ``summary``),
    averaged over its steps: the mean over the steps t of ``||G_t|| / sqrt(P)``, ``P`` its
    trainable parameters. ``norms.jsonl`` must hold a record for every step that updated
    (:func:`~fira_train.analysis.runs.read_step_records`)."""
    parameters = summary["trainable_parameters"]
    norms = [r["grad_norm"] for r in read_step_records(run_dir / NORMS_FILE, summary)]
    return float(sum(norms) / len(norms)) / math.sqrt(parameters)


def _plot(out: Path, methods: Sequence[str], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for m in methods:
        for name, style in ((m, "-"), (noisy_name(m), "--")):
            evals = [(r["step"], r["val_ppl"]) for r in read_metrics(out / name)
                     if r.get("val_ppl") is not None and math.isfinite(r["val_ppl"])]  # null: not finite
            if evals:
                ax.plot(*zip(*evals), style, marker="o", markersize=3, label=name)
    ax.set(xlabel="step", ylabel="validation perplexity", yscale="log",
           title="Validation perplexity with and without gradient noise")
    plain_log_ticks(ax.yaxis)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def run_noise(config: RunConfig, out_dir: str | Path, *, methods: Sequence[str] = DEFAULT_METHODS,
              scale: float = DEFAULT_SCALE, reuse: bool = False, overwrite: bool = False, jobs: int = 1,
              command: str | None = None,
              given: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Train each method with and without noise; write ``OUT/report.md`` and ``OUT/noise.png``."""
    for m in methods:
        get_method(m)
    GradientNoise(scale)  # validates the scale before anything trains
    refuse_step_in_backward(config, "adds noise to each step's gradients and records their norms")
    out = Path(out_dir)
    summaries = train_runs(config, noise_runs(methods, scale, config.train.seed), out,
                           reuse=reuse, overwrite=overwrite, jobs=jobs, title=TITLE, given=given)
    table = {m: (summaries[m]["val_ppl"], summaries[noisy_name(m)]["val_ppl"]) for m in methods}
    figure = out / "noise.png"
    _plot(out, methods, figure)
    lines = report_header(TITLE, config, command=command)
    low_rank = any(m in fira_optim.VARIANTS for m in methods)
    rank_text = f"; rank {config.optim.rank} for the low-rank methods" if low_rank else ""
    lines += [f"Final validation perplexity without and with Gaussian noise {scale:g} * N(0, 1) added to every "
              f"gradient entry before each step (its seed derived from the run's, {config.train.seed}); "
              "learning rates: "
              + ", ".join(f"{m} {summaries[m]['lr']:g}" for m in methods) + rank_text + ".", ""]
    rows = []
    for m in methods:
        clean, noisy = table[m]
        paper = PAPER.get(m)
        rows.append([m, paper[0] if paper else "-", paper[1] if paper else "-",
                     f"{100 * (paper[1] / paper[0] - 1):+.1f}%" if paper else "-",
                     clean, noisy, f"{100 * (noisy / clean - 1):+.1f}%"])
    lines += [markdown_table(["method", "paper: without", f"paper: with noise {DEFAULT_SCALE:g}", "paper: change",
                              "measured: without", f"measured: with noise {scale:g}", "measured: change"], rows), ""]
    if scale != DEFAULT_SCALE:
        lines += [f"The paper's columns are at its noise {DEFAULT_SCALE:g}, these runs at {scale:g}: compare the "
                  "direction of the changes, not their size.", ""]
    rms = {m: gradient_rms(out / m, summaries[m]) for m in methods}
    lines += ["Size of the noise against the gradient: root-mean-square gradient entry of the noise-free "
              "runs, averaged over the steps: "
              + ", ".join(f"{m} {rms[m]:.3g} (noise / gradient = {scale / rms[m]:.3g})" for m in methods)
              + ". The paper reports no gradient magnitudes for LLaMA 60M, so how the ratio compares is not known.",
              ""]
    lines += ["![validation perplexity with and without noise](noise.png)", ""]
    report = out / "report.md"
    write_text_atomic(report, "\n".join(lines) + "\n")
    return {"report": report, "figure": figure, "table": table, "summaries": summaries}
