"""A sweep's files: ``sweep.json`` (every run and the summary), ``report.md`` and ``lr.png``
(validation perplexity against learning rate, one line per method, error bars over seeds).

Written after every finished run, so a sweep spread over several sittings always has a report
of what is done (provisional rows say so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fira_train.files import dumps, write_text_atomic
from fira_train.report.markdown import SWEEP_REPORT_TITLE as REPORT_TITLE
from fira_train.report.markdown import code_line
from fira_train.report.plots import plain_log_ticks, pyplot, save_figure
from fira_train.sweep.grid import RunKey, RunResult
from fira_train.sweep.stats import PairedDifference
from fira_train.sweep.summary import MethodSummary, summary_json


def _num(value: float | None, spec: str = ".2f") -> str:
    """A perplexity: ``inf`` (JSON's ``null`` for a run with a test set) is a diverged run."""
    if value is None:
        return "-"
    return "diverged" if math.isinf(value) else format(value, spec)


def _spread(mean: float, sd: float | None, n: int, diverged: int | None = None) -> str:
    """Mean ± sd over ``n`` runs; a mean one diverged run made infinite says how many of the
    ``n`` diverged (``diverged``), so that one seed of three is not read as all three."""
    if math.isinf(mean):
        # no count where none is flagged: a finished run whose perplexity overflowed is inf too
        return f"diverged ({diverged} of {n} runs)" if diverged else "diverged"
    return f"{mean:.2f} ± {sd:.2f} (n={n})" if sd is not None else f"{mean:.2f} (n=1)"


def _diverged(values: Sequence[float]) -> int:
    return sum(math.isinf(v) for v in values)


def _none_chosen(row: MethodSummary) -> bool:
    """Whether the row's grid of several lrs had a diverged run at every lr (every mean is
    infinite): its "choice" (the smallest lr, by the tie rule) is no choice at all. One lr, given
    by the command, is not chosen either way (and stands, diverged, as a reference)."""
    return len(row.grid) > 1 and all(s is not None and math.isinf(s.mean) for s in row.grid.values())


def _difference(d: PairedDifference | None) -> str:
    if d is None:
        return "-"
    if math.isnan(d.mean):
        return f"no order: runs diverged on both sides (n={d.n}, no interval)"
    if math.isinf(d.mean):  # the direction survives, the size does not
        side = "this method diverged" if d.mean > 0 else "the reference diverged"
        return f"{d.mean:+}: {side} (n={d.n}, no interval)"
    if d.low is None:
        return f"{d.mean:+.2f} (n={d.n}, no interval)"
    return f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}] (n={d.n})" + (" *" if d.excludes_zero else "")


def _seed_table(rows: Sequence[MethodSummary], seeds: Sequence[int]) -> list[str]:
    """Validation / test perplexity of every seed at each method's chosen lr."""
    lines = ["## Each seed at the chosen lr", "",
             "Validation / test perplexity; the same seed gives every method the same initialisation "
             "and data order.", "",
             "| Method | lr | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|---|" + "---|" * len(seeds)]
    for row in rows:
        if row.chosen_lr is None or _none_chosen(row):  # a grid that diverged everywhere: no lr was chosen
            continue
        cells = [f"{_num(row.val_by_seed[s])} / {_num(row.test_by_seed.get(s))}" if s in row.val_by_seed else ""
                 for s in seeds]
        lines.append(f"| {row.spec} | {row.chosen_lr:g} | " + " | ".join(cells) + " |")
    return lines


def write_json(path: Path, settings: dict[str, Any], results: dict[RunKey, RunResult],
               rows: Sequence[MethodSummary]) -> Path:
    # "test_set": whether the run had a test set, so that a null test_ppl reads back as a
    # non-finite perplexity (inf), not as "no test set", even for a run that finished; a diverged
    # run's test perplexity is inf (as summarize and read_runs take it), written so
    runs = [{"spec": k.spec, "lr": k.lr, "seed": k.seed, "val_ppl": r.val_ppl, "test_ppl": r.test_ppl,
             "test_set": r.test_ppl is not None or r.diverged, "diverged": r.diverged, **({"error": r.detail} if r.detail else {}),
             "code": r.code}
            for k, r in sorted(results.items(), key=lambda kr: (kr[0].spec, kr[0].lr, kr[0].seed))]
    payload = {**settings, "runs": runs, "methods": summary_json(rows)}
    return write_text_atomic(path, dumps(payload, indent=1) + "\n")


def read_runs(saved: dict[str, Any]) -> dict[RunKey, RunResult]:
    """The runs of a ``sweep.json`` (as :func:`write_json` wrote them) back as results; JSON holds
    ``null`` where a perplexity was not finite, and a finished run's ``test_set`` tells that from
    a run without a test set (in a file written before it existed, a finished run's null reads as
    no test set). A diverged run's null test perplexity is inf, as :func:`summarize` takes it."""
    results: dict[RunKey, RunResult] = {}
    for run in saved["runs"]:
        key = RunKey(run["spec"], float(run["lr"]), int(run["seed"]))
        val = math.inf if run["val_ppl"] is None else float(run["val_ppl"])
        had_test = run.get("test_set", False) or run["diverged"]
        test = (math.inf if had_test else None) if run["test_ppl"] is None else float(run["test_ppl"])
        results[key] = RunResult(key, val, test, diverged=bool(run["diverged"]), detail=run.get("error", ""),
                                 code=run.get("code"))
    return results


#: Points between marks stacked at one lr on the figure's top edge.
_STACK_PT = 12.0


def plot_lr(path: Path, rows: Sequence[MethodSummary]) -> Path:
    """``lr.png``: mean validation perplexity (error bars: sd over seeds) against lr, log-log.

    A diverged mean (inf) has no height: it is drawn as an ``x`` on the top edge at its lr, in
    the method's colour (the chosen lr's star too, when a seed diverged there), so that a method
    whose every lr diverged is still in the figure and its legend. Marks of several methods at one
    lr are stacked up from the edge, one above the other, so that none hides another."""
    from matplotlib.transforms import ScaledTranslation, blended_transform_factory

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    stacked: dict[float, int] = {}  # lr -> marks drawn on the top edge there so far

    def at_top(lr: float, **style: Any):
        """One mark at ``lr`` on the top edge, above those drawn there before."""
        above = stacked.get(lr, 0)
        stacked[lr] = above + 1
        # up from the edge, out of the axes (where no perplexity is); x stays in data coordinates,
        # which alone keeps the lr inside the x limits
        raised = blended_transform_factory(
            ax.transData, ax.transAxes + ScaledTranslation(0.0, _STACK_PT * above / 72.0, fig.dpi_scale_trans))
        mark, = ax.plot([lr], [1.0], linestyle="none", transform=raised, clip_on=False, **style)
        return mark

    legend = []  # in the rows' order (matplotlib's own puts plain markers before error bars)
    for index, row in enumerate(rows):
        color = f"C{index % 10}"  # by row, so a method without a finite point keeps its own colour
        points = sorted((lr, s) for lr, s in row.grid.items() if s is not None and math.isfinite(s.mean))
        diverged = sorted(lr for lr, s in row.grid.items() if s is not None and not math.isfinite(s.mean))
        if points:
            lrs = [lr for lr, _ in points]
            means = [s.mean for _, s in points]
            errors = [s.sd or 0.0 for _, s in points]
            legend.append((ax.errorbar(lrs, means, yerr=errors, marker="o", markersize=4, capsize=3, color=color),
                           row.spec))
        marks = [at_top(lr, marker="x", markersize=8, markeredgewidth=2, color=color) for lr in diverged]
        if marks and not points:
            legend.append((marks[0], f"{row.spec} (every lr diverged)"))
        if row.chosen_lr is not None and row.val is not None and (points or math.isfinite(row.val.mean)):
            if math.isfinite(row.val.mean):
                ax.plot([row.chosen_lr], [row.val.mean], marker="*", markersize=13, color=color, linestyle="none")
            else:
                at_top(row.chosen_lr, marker="*", markersize=13, color=color)
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="validation perplexity (final)")
    # the x explained where one is drawn: a figure without one showed no divergence
    marks = "; x on the top edge and above it: diverged" if stacked else ""
    ax.set_title(f"Learning-rate sweep\nstar: chosen lr, mean of all its seeds{marks}",
                 pad=6.0 + _STACK_PT * (max(stacked.values(), default=1) - 1))  # above the stacked marks
    if any(s is not None and math.isfinite(s.mean) for row in rows for s in row.grid.values()):
        ax.set_yscale("log")
        plain_log_ticks(ax.xaxis, ax.yaxis)
    else:  # every run so far diverged: no height to give, and no numbers that would suggest one
        ax.set_yticks([])
        plain_log_ticks(ax.xaxis)
    ax.grid(alpha=0.3, which="both")
    # beside the axes: inside them it hid the points at the edges of the grid
    if legend:
        ax.legend(*zip(*legend), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def write_markdown(path: Path, settings: dict[str, Any], rows: Sequence[MethodSummary],
                   codes: Sequence[str | None] = ()) -> Path:
    """``report.md``; ``codes``: the code each run was made by, one entry per run (see
    :func:`code_line`)."""
    reference = settings["reference"]
    seeds = settings["seeds"]
    lrs_union = sorted({lr for row in rows for lr in row.grid})
    lines = [
        f"{REPORT_TITLE}: recipe `{settings['recipe']}`",
        "",
        f"Each method's learning rate is chosen on the **validation** set (lowest mean final "
        f"perplexity over the grid's seeds at that lr; grid at seed{'s' if settings['all_seeds'] and len(seeds) > 1 else ''} "
        f"{', '.join(map(str, seeds if settings['all_seeds'] else seeds[:1]))}), then trained with "
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} at that lr. The **test** set (held out from training and "
        f"validation) is evaluated once per run and used for no choice.",
        "",
        f"| Method | chosen lr | val. PPL at it | test PPL, mean ± sd | test PPL − {reference} "
        f"(paired by seed, 95% interval) | val. PPL − {reference} (paired) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        flags = []
        if not row.complete:
            flags.append("grid incomplete")
        if len(row.grid) == 1:  # set by the command, not chosen on validation
            flags.append("one lr: not chosen")
        if _none_chosen(row):
            flags = ["a run diverged at every lr: none chosen"]  # the smallest lr, by the tie rule, shown as such
        elif row.at_edge:
            flags.append("at the grid's edge")
        chosen = "-" if row.chosen_lr is None else f"{row.chosen_lr:g}" + (f" ({', '.join(flags)})" if flags else "")
        val = "-" if row.val is None else _spread(row.val.mean, row.val.sd, row.val.n,
                                                  _diverged(list(row.val_by_seed.values())))
        test = "-" if row.test is None else _spread(row.test.mean, row.test.sd, row.test.n,
                                                    _diverged(list(row.test_by_seed.values())))
        if row.spec == reference:
            diffs = ["(reference)", "(reference)"]
        else:
            diffs = [_difference(row.vs_reference), _difference(row.val_vs_reference)]
        lines.append(f"| {row.spec} | {chosen} | {val} | {test} | {diffs[0]} | {diffs[1]} |")
    lines += [
        "",
        "`*`: the 95% interval excludes 0. Intervals: Student's t on the per-seed differences "
        "(the same seed gives both methods the same initialisation and data order). A row with one "
        "seed has no interval and shows no ordering. The validation split also chose the learning "
        "rates, so its differences are not held-out estimates: the test column is.",
        "",
        "## Validation perplexity at each learning rate",
        "",
        "Mean over the grid's seeds run at that lr (n; the choice is made on these); `diverged`: a run's "
        "loss became non-finite or exploded.",
        "",
        "| Method | " + " | ".join(f"lr {lr:g}" for lr in lrs_union) + " |",
        "|---|" + "---|" * len(lrs_union),
    ]
    for row in rows:
        cells = []
        for lr in lrs_union:
            s = row.grid.get(lr)
            if lr not in row.grid:
                cells.append("")
            elif s is None:
                cells.append("pending")
            else:
                cell = _spread(s.mean, s.sd, s.n, row.diverged.get(lr))
                chosen_here = lr == row.chosen_lr and not _none_chosen(row)
                cells.append(f"**{cell}**" if chosen_here else cell)
        lines.append(f"| {row.spec} | " + " | ".join(cells) + " |")
    lines += ["", "![validation perplexity against learning rate](lr.png)", "", *_seed_table(rows, seeds),
              "", code_line(codes)]
    if settings.get("command"):
        lines += ["", "Command:", "", "```bash", settings["command"], "```"]
    return write_text_atomic(path, "\n".join(lines) + "\n")
