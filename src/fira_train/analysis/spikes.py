r"""Loss spikes: the limiter figure and the GaLore-add figure.

Runs (same initialisation and batches), each with a
:class:`~fira_train.analysis.callbacks.NormRecorder`:

- ``fira``, ``fira-no-limiter`` and ``fira-clip``: training loss, the raw gradient norm and
  the norm of the scaled residual :math:`\|S_t\|` the optimizer applied, with the projection
  refreshes (every ``T`` steps) marked (the paper's limiter figure: without the limiter, spikes
  in gradient norm and loss);
- ``galore`` and ``galore-add`` (:math:`W \mathrel{-}= \eta (P\psi(R) + (G - PR))`): training
  loss with multiples of ``T`` marked (the paper: spikes at the refreshes for both, more for
  GaLore-add).

Spike statistics, from the per-step loss :math:`\ell_t` (before update ``t``): the largest
one-step rise :math:`\max_t (\ell_t - \ell_{t-1})`, the number of steps whose loss exceeds
the mean of the previous ``window`` steps by more than ``threshold`` (relative), and the mean
one-step change of the loss at the steps right after a refresh (the update of step
:math:`kT + 1` is the first with a new basis; its effect shows in :math:`\ell_{kT+2}`)
against all other steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fira_train.analysis.callbacks import NORMS_FILE, record_norms
from fira_train.analysis.runs import (AnalysisRun, markdown_table, read_step_records, refuse_step_in_backward,
                                      report_header, train_runs)
from fira_train.config.run_config import RunConfig
from fira_train.files import write_text_atomic
from fira_train.methods.registry import get_method
from fira_train.report.plots import pyplot, save_figure

#: The heading of this analysis's report (train_runs refuses a folder whose report.md has another).
TITLE = "Loss spikes: the norm-growth limiter and GaLore-add"

LIMITER_RUNS = ("fira", "fira-no-limiter", "fira-clip")
GALORE_RUNS = ("galore", "galore-add")


def spike_runs(names: Sequence[str], rank_of: dict[str, int] | None = None) -> list[AnalysisRun]:
    """One run per name, recording norms; ``rank_of`` overrides the rank of some runs."""
    rank_of = rank_of or {}
    return [AnalysisRun(n, n, tuple([f"optim.rank={rank_of[n]}"] if n in rank_of else []),
                        callbacks=record_norms, describe="NormRecorder")
            for n in names]


def spike_statistics(losses: Sequence[float], gap: int, *, window: int = 5,
                     threshold: float = 0.05) -> dict[str, float]:
    """Spike measures of a loss curve (``losses[i]`` is the loss of step ``i + 1``)."""
    loss = np.asarray(losses, dtype=np.float64)
    if loss.size < 2:
        raise ValueError(f"need at least 2 losses, got {loss.size}")
    if gap < 1:
        raise ValueError(f"gap must be >= 1, got gap={gap}")
    steps = np.arange(1, loss.size + 1)
    rise = np.diff(loss)  # rise[i] = loss of step i + 2 - loss of step i + 1
    after_refresh = (steps[1:] - 2) % gap == 0  # steps kT + 2
    after_refresh &= steps[1:] > 2  # the first basis (step 1) is not a refresh
    spikes = 0
    for i in range(window, loss.size):
        if loss[i] > (1 + threshold) * loss[i - window:i].mean():
            spikes += 1
    return {
        "max_rise": float(rise.max()),
        "max_rise_step": int(steps[1:][rise.argmax()]),
        "spikes": float(spikes),
        "mean_change_after_refresh": float(rise[after_refresh].mean()) if after_refresh.any() else math.nan,
        "mean_change_elsewhere": float(rise[~after_refresh].mean()),
    }


def _after_refresh(change: float) -> str:
    """The mean loss change after a refresh, or that the run measured none (shorter than T + 2
    steps). A run of T + 1 steps did refresh, at its last step (the figure marks it): only the
    loss after it is missing."""
    return f"{change:+.4f}" if math.isfinite(change) else "none (no loss measured after a refresh)"


def _rise(change: float) -> str:
    """The largest one-step loss change, or "none" where the loss fell at every step."""
    return f"{change:.3f}" if change > 0 else "none"


def _median(values: Sequence[float]) -> float:
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    return float(np.median(v)) if v.size else math.nan


def _peak_ratio(values: Sequence[float]) -> float:
    """max / median: how far the largest value stands above the typical one."""
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    return float(v.max() / np.median(v)) if v.size else math.nan


def _plot(records: Mapping[str, Sequence[dict[str, Any]]], limiter: Sequence[str], galore: Sequence[str], gap: int,
          steps: int, path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    panels = (1 if limiter else 0) * 2 + (1 if galore else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    refreshes = list(range(gap + 1, steps + 1, gap))

    def mark(ax):
        """Dashed refresh lines, and a grid of horizontal lines only: solid thin grey lines at
        both read alike, so that no refresh could be told from a grid line."""
        for s in refreshes:
            ax.axvline(s, color="grey", alpha=0.7, linewidth=0.9, linestyle="--")
        ax.grid(alpha=0.3, axis="y")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no tick at 2.5

    if limiter:
        ax_loss, ax_norm = axes.pop(0), axes.pop(0)
        for index, name in enumerate(limiter):
            rec = records[name]
            x = [r["step"] for r in rec]
            color = f"C{index}"  # one colour per run in both panels
            ax_loss.plot(x, [r["loss"] for r in rec], label=name, linewidth=1, color=color)
            ax_norm.plot(x, [r.get("residual_norm", math.nan) for r in rec], label=f"{name}: ||S_t||",
                         linewidth=1.2, color=color)
            ax_norm.plot(x, [r["grad_norm"] for r in rec], linestyle=":", linewidth=1, color=color,
                         label=f"{name}: ||G||")
        ax_loss.set(title="Fira variants: training loss", xlabel="step", ylabel="loss")
        ax_norm.set(title="Gradient norms (S_t after limiter; raw G)", xlabel="step", ylabel="norm", yscale="log")
        for ax in (ax_loss, ax_norm):
            mark(ax)
            ax.legend(fontsize=7)
    if galore:
        ax = axes.pop(0)
        for name in galore:
            rec = records[name]
            ax.plot([r["step"] for r in rec], [r["loss"] for r in rec], label=name, linewidth=1)
        mark(ax)
        ax.set(title=f"GaLore vs GaLore-add (dashed: refreshes, T = {gap})", xlabel="step", ylabel="loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def run_spikes(config: RunConfig, out_dir: str | Path, *, limiter_runs: Sequence[str] = LIMITER_RUNS,
               galore_runs: Sequence[str] = GALORE_RUNS, galore_rank: int | None = 16, reuse: bool = False,
               overwrite: bool = False, jobs: int = 1, command: str | None = None,
               given: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Train the runs, write ``OUT/report.md`` and ``OUT/spikes.png``; returns the statistics.

    The ``galore_runs`` use rank ``galore_rank`` (default 16, the paper's GaLore-add figure has
    r/d_model = 16/256; None keeps the config's rank), the ``limiter_runs`` the config's rank.
    """
    names = list(dict.fromkeys([*limiter_runs, *galore_runs]))
    if not names:
        raise ValueError("spikes needs at least one run")
    refuse_step_in_backward(config, "records each step's gradient norm")
    if config.train.steps < 2:  # a spike is a step's loss against the ones before it
        raise ValueError(f"spikes needs at least 2 steps per run (--steps), got train.steps={config.train.steps}")
    for n in names:
        get_method(n)
    out = Path(out_dir)
    if galore_rank is not None and not (isinstance(galore_rank, int) and 1 <= galore_rank < config.model.hidden_size):
        raise ValueError(f"galore_rank (--galore-rank) must be an int in [1, d_model={config.model.hidden_size}), got {galore_rank!r}")
    rank_of = {n: galore_rank for n in galore_runs if galore_rank is not None and n not in limiter_runs}
    # The Fira runs take optim.rank from the config, the GaLore runs --galore-rank.
    summaries = train_runs(config, spike_runs(names, rank_of), out,
                           reuse=reuse, overwrite=overwrite, jobs=jobs, title=TITLE, given=given,
                           partly_set=("optim.rank",))
    gap, steps = config.optim.update_proj_gap, config.train.steps
    # a step's record for every step of each run (checked: the table's last loss is the final one)
    records = {n: read_step_records(out / n / NORMS_FILE, summaries[n]) for n in names}
    stats = {n: spike_statistics([r["loss"] for r in rec], gap) for n, rec in records.items()}
    figure = out / "spikes.png"
    _plot(records, limiter_runs, galore_runs, gap, steps, figure)

    lines = report_header(TITLE, config, command=command)
    # each run at the rank it trained with (a GaLore run among the limiter runs takes the config's)
    by_rank: dict[int, list[str]] = {}
    for name in names:
        by_rank.setdefault(rank_of.get(name, config.optim.rank), []).append(name)
    ranks = "; ".join(f"rank {rank} for {', '.join(runs)}" for rank, runs in by_rank.items())
    lines += [f"Per-step training loss and norms ({ranks}; d_model {config.model.hidden_size}); "
              f"projection refreshed every T = {gap} steps. "
              "Spikes: steps whose loss exceeds the mean of the previous 5 steps by more than 5%. "
              "Change after refresh: mean loss change from step kT + 1 to kT + 2 (the first update "
              "with a new basis), against the mean change at all other steps.", ""]
    rows = []
    for n in names:
        s, rec = stats[n], records[n]
        residual = [r.get("residual_norm", math.nan) for r in rec]
        has_residual = "residual_norm" in rec[-1]
        after = s["mean_change_after_refresh"]  # nan: no loss after a refresh (steps < T + 2)
        rose = s["max_rise"] > 0  # else the loss fell at every step: its smallest drop is no rise
        rows.append([n, s["max_rise"] if rose else "none", s["max_rise_step"] if rose else "-", int(s["spikes"]),
                     after if math.isfinite(after) else "-",
                     s["mean_change_elsewhere"], _peak_ratio([r["grad_norm"] for r in rec]),
                     _peak_ratio(residual) if has_residual else "-", _median(residual) if has_residual else "-",
                     rec[-1]["loss"]])
    lines += [markdown_table(["run", "max 1-step loss rise", "at step", "spikes", "change after refresh",
                              "change elsewhere", "max/median ‖G‖", "max/median ‖S_t‖", "median ‖S_t‖",
                              "final loss"], rows), ""]
    lines += ["‖G‖: global norm of the raw gradient before the step; ‖S_t‖: global norm of the scaled "
              "residual after the stabiliser (the Fira family's `prev_norm`). With batches of "
              f"{config.train.batch_size} x {config.data.seq_len} tokens the per-step loss is noisy, which "
              "the spike count (5% above the previous 5 steps) also picks up.", ""]
    lines += ["## Paper vs measured", "",
              "- Paper (limiter figure, LLaMA 60M): Fira-w.o.-limiter shows spikes in both gradient norm and "
              "training loss early in training; gradient clipping does not remove them fully; Fira with the "
              "limiter trains without significant spikes."]
    if all(n in stats for n in LIMITER_RUNS):
        lines.append("- Measured: spikes (count / largest rise) "
                     + ", ".join(f"{n} {int(stats[n]['spikes'])} / {_rise(stats[n]['max_rise'])}" for n in LIMITER_RUNS)
                     + "; max/median ‖S_t‖ "
                     + ", ".join(f"{n} {_peak_ratio([r.get('residual_norm', math.nan) for r in records[n]]):.2f}"
                                 for n in LIMITER_RUNS) + "; median ‖S_t‖ "
                     + ", ".join(f"{n} {_median([r.get('residual_norm', math.nan) for r in records[n]]):.3g}"
                                 for n in LIMITER_RUNS)
                     + ". Where fira's median ‖S_t‖ is far below fira-no-limiter's, the limiter is holding "
                     "the residual down for most of the run (it only lets ‖S_t‖ grow by gamma per step "
                     "after any drop, e.g. at a projection refresh), not only at spikes.")
    lines.append("- Paper (GaLore-add figure, r/d_model = 16/256, T = 200): GaLore and GaLore-add spike at "
                 "multiples of T; GaLore-add spikes more and is hardly better than GaLore.")
    if all(n in stats for n in GALORE_RUNS):
        lines.append("- Measured: mean loss change after a refresh vs elsewhere: "
                     + ", ".join(f"{n} {_after_refresh(stats[n]['mean_change_after_refresh'])} vs "
                                 f"{stats[n]['mean_change_elsewhere']:+.4f}" for n in GALORE_RUNS)
                     + "; spikes " + ", ".join(f"{n} {int(stats[n]['spikes'])}" for n in GALORE_RUNS)
                     + "; final loss " + ", ".join(f"{n} {records[n][-1]['loss']:.3f}" for n in GALORE_RUNS) + ".")
    lines += ["", "![loss and gradient norms](spikes.png)", ""]
    report = out / "report.md"
    write_text_atomic(report, "\n".join(lines) + "\n")
    return {"report": report, "figure": figure, "stats": stats}
