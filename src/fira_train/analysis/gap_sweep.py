"""Validation perplexity against the subspace update gap T (how often the projection is refreshed).

Not one of the paper's figures: the paper fixes T = 200 (50 refreshes over 60M's 10K steps, 500
over 1B's 100K). The CPU recipes keep "about 50 refreshes per run" (T = steps / 50), and this
sweep is the measurement that says whether a recipe may refresh less often: every exact SVD
refresh costs as much as several optimizer steps, so T sets most of Fira's throughput cost on a
small model.

Runs: each method of ``methods`` (default Fira and GaLore) at each gap of ``gaps`` and each
seed of ``seeds``, all other settings from the recipe. Runs of one seed share their
initialisation and batches. The table gives the mean final validation perplexity over the seeds
per method and gap, with the seeds' spread (max - min) beside it; the findings compare each gap
with the recipe's own T seed by seed (the same seed shares initialisation and batches, so the
paired change is what a difference between gaps has to show, against the seeds' disagreement).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import fira_optim
from fira_train.analysis.runs import AnalysisRun, markdown_table, report_header, seeds_text, train_runs
from fira_train.config.run_config import RunConfig
from fira_train.files import write_text_atomic
from fira_train.methods.registry import get_method
from fira_train.report.plots import pyplot, save_figure

#: The heading of this analysis's report (train_runs refuses a folder whose report.md has another).
TITLE = "Validation perplexity under varying update gaps"

DEFAULT_GAPS = (3, 6, 12, 25, 50)
DEFAULT_METHODS = ("fira", "galore")


def run_name(method: str, gap: int, seed: int | None) -> str:
    return f"{method}-T{gap}" + ("" if seed is None else f"-s{seed}")


def gap_sweep_runs(methods: Sequence[str], gaps: Sequence[int], seeds: Sequence[int]) -> list[AnalysisRun]:
    """One run per method, gap and seed; with one seed the names carry no seed suffix."""
    runs = []
    for seed in seeds:
        label = seed if len(seeds) > 1 else None
        runs += [AnalysisRun(run_name(m, g, label), m, (f"optim.update_proj_gap={g}", f"train.seed={seed}"))
                 for m in methods for g in gaps]
    return runs


def _check(config: RunConfig, gaps: Sequence[int], methods: Sequence[str], seeds: Sequence[int]) -> None:
    steps = config.train.steps
    for g in gaps:
        if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= steps:
            # the defaults name no --gaps the user gave: a short recipe (micro's 20 steps) refused 25
            raise ValueError(f"gaps (--gaps) must be ints in [1, steps={steps}] (--steps), got {g!r}"
                             + (f" (of the default gaps {','.join(map(str, DEFAULT_GAPS))}: give --gaps up to {steps}, "
                                "or more --steps)" if tuple(gaps) == DEFAULT_GAPS else ""))
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"seeds (--seeds) must be ints >= 0, got {s!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds (--seeds) must be distinct, got {list(seeds)!r}")
    for m in methods:
        get_method(m)  # an unknown name gets the registry's error, with the valid names
        if m not in fira_optim.VARIANTS:  # the FiraAdamW family: the methods with an update gap
            raise ValueError(f"method {m!r} refreshes no projection (--methods); the sweep takes the Fira / "
                             "GaLore family")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "es")


def _paired(row: dict[int, list[float]], gap: int, ref: int) -> str:
    """``row[gap]`` relative to ``row[ref]``, seed by seed: a seed's initialisation and batches
    shift every gap alike, so the paired change is what tells gaps apart."""
    changes = [100 * (a / b - 1) for a, b in zip(row[gap], row[ref])]
    text = f"T = {gap} {sum(changes) / len(changes):+.1f}%"
    if len(changes) > 1:
        text += " (" + " / ".join(f"{c:+.1f}%" for c in changes) + ")"
    return text


def _plot(values: dict[str, dict[int, list[float]]], gaps: Sequence[int], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for method, row in values.items():
        means = [sum(row[g]) / len(row[g]) for g in gaps]
        several = any(len(row[g]) > 1 for g in gaps)
        # with several seeds the legend says which marks are the means and which the seeds' runs
        line, = ax.plot(list(gaps), means, marker="o", label=f"{method}: mean over seeds" if several else method)
        if several:
            ax.scatter([g for g in gaps for _ in row[g]], [v for g in gaps for v in row[g]],
                       color=line.get_color(), s=12, alpha=0.5, label=f"{method}: each seed")
    ax.set(xscale="log", xlabel="update gap T (steps between refreshes)", ylabel="validation perplexity",
           title="Validation perplexity vs update gap")
    ax.set_xticks(list(gaps), [str(g) for g in gaps])
    ax.minorticks_off()  # under a decade and a half, log minor ticks get labels that overlap the gaps
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def run_gap_sweep(config: RunConfig, out_dir: str | Path, *, gaps: Sequence[int] = DEFAULT_GAPS,
                  methods: Sequence[str] = DEFAULT_METHODS, seeds: Sequence[int] | None = None,
                  reuse: bool = False, overwrite: bool = False, jobs: int = 1,
                  command: str | None = None,
                  given: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Train the sweep and write ``OUT/report.md`` and ``OUT/gaps.png``.

    Returns ``{"report", "figure", "table", "values", "summaries"}``: ``values[method][gap]``
    lists the final validation perplexity of each seed, ``table[method][gap]`` their mean.
    ``seeds`` defaults to the config's seed alone.
    """
    gaps = sorted(set(gaps))
    seeds = list(seeds) if seeds is not None else [config.train.seed]
    _check(config, gaps, methods, seeds)
    out = Path(out_dir)
    summaries = train_runs(config, gap_sweep_runs(methods, gaps, seeds), out,
                           reuse=reuse, overwrite=overwrite, jobs=jobs, title=TITLE, given=given)
    label = (lambda s: s) if len(seeds) > 1 else (lambda s: None)
    values = {m: {g: [summaries[run_name(m, g, label(s))]["val_ppl"] for s in seeds] for g in gaps}
              for m in methods}
    table = {m: {g: sum(v) / len(v) for g, v in row.items()} for m, row in values.items()}

    figure = out / "gaps.png"
    _plot(values, gaps, figure)
    steps = config.train.steps
    recipe_gap = config.optim.update_proj_gap
    lines = report_header(TITLE, config, command=command,
                          seeds=seeds)
    seed_text = seeds_text(seeds) if len(seeds) == 1 else f"mean over {seeds_text(seeds)}"
    lines += [f"Final validation perplexity ({seed_text}) at rank {config.optim.rank}; the recipe's own T is "
              f"{recipe_gap}. Refreshes: projection refreshes per run (steps / T, rounded up).", ""]
    header = ["method"] + [f"T = {g} ({_count(math.ceil(steps / g), 'refresh')})" for g in gaps]
    rows = []
    for m in methods:
        cells = []
        for g in gaps:
            v = values[m][g]
            cells.append(f"{table[m][g]:.2f}" + (f" (spread {max(v) - min(v):.2f})" if len(v) > 1 else ""))
        rows.append([m] + cells)
    lines += [markdown_table(header, rows), ""]
    if len(seeds) > 1:
        # the means' precision: seeds that tie at 4 significant digits are told apart here
        per_seed = [[f"{m}, seed {s}"] + [f"{values[m][g][i]:.2f}" for g in gaps]
                    for m in methods for i, s in enumerate(seeds)]
        lines += ["Per seed:", "", markdown_table(["run"] + [f"T = {g}" for g in gaps], per_seed), ""]
    findings = []
    for m in methods:
        best = min(gaps, key=lambda g: table[m][g])
        text = f"- {m}: lowest at T = {best} ({table[m][best]:.2f})"
        if recipe_gap in table[m] and len(gaps) > 1:
            text += (f"; against the recipe's T = {recipe_gap} ({table[m][recipe_gap]:.2f}), seed by seed: "
                     + ", ".join(_paired(values[m], g, recipe_gap) for g in gaps if g != recipe_gap))
        findings.append(text + ".")
    if "fira" in table and "galore" in table:
        better = sum(table["fira"][g] < table["galore"][g] for g in gaps)
        text = f"- fira's mean below galore's at {better} of {len(gaps)} gaps"
        if len(seeds) > 1:  # the same seed shares initialisation and batches: compare seed by seed
            text += "; seed by seed, fira below galore at " + ", ".join(
                f"T = {g} in {sum(a < b for a, b in zip(values['fira'][g], values['galore'][g]))} of {len(seeds)}"
                for g in gaps) + " seeds"
        findings.append(text + ".")
    lines += ["Measured:", "", *findings, "", "![perplexity vs update gap](gaps.png)", ""]
    report = out / "report.md"
    write_text_atomic(report, "\n".join(lines) + "\n")
    return {"report": report, "figure": figure, "table": table, "values": values, "summaries": summaries}


__all__ = ["DEFAULT_GAPS", "DEFAULT_METHODS", "gap_sweep_runs", "run_gap_sweep"]
