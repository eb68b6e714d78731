"""What a sweep concludes from its runs: each method's learning rate, chosen on validation, and at
that lr the validation and test perplexity over seeds and their paired differences to the
reference method.

Choice: for each spec, the lr with the lowest mean validation perplexity over the grid's seeds
(the first seed, or every seed with ``all_seeds``; a diverged run counts as infinite). The seeds
added at the chosen lr afterwards do not move the choice. The test set never enters a choice. A choice at either
end of the grid is flagged: the best lr may lie outside it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from fira_train.sweep.grid import RunKey, RunResult
from fira_train.sweep.stats import PairedDifference, Spread, paired_difference, spread


@dataclass
class MethodSummary:
    """One spec's row of the sweep."""

    spec: str
    grid: dict[float, Spread | None]
    """lr -> validation perplexity over the grid's seeds run at it (None: none finished yet)."""
    diverged: dict[float, int]
    """lr -> how many of its runs diverged."""
    chosen_lr: float | None = None
    at_edge: bool = False
    complete: bool = False
    """Whether every lr of its grid has a result at every grid seed (else the choice is provisional)."""
    val: Spread | None = None
    test: Spread | None = None
    val_by_seed: dict[int, float] = field(default_factory=dict)
    test_by_seed: dict[int, float] = field(default_factory=dict)
    vs_reference: PairedDifference | None = None
    """Test perplexity minus the reference's, paired by seed."""
    val_vs_reference: PairedDifference | None = None
    """Validation perplexity minus the reference's, paired by seed (at each one's chosen lr)."""


def choose_lr(grid: dict[float, Spread | None]) -> float | None:
    """The lr of the lowest mean validation perplexity (ties: the smaller lr); None if none ran."""
    done = [(s.mean, lr) for lr, s in grid.items() if s is not None]
    return min(done)[1] if done else None


def summarize(specs: Sequence[str], lrs: dict[str, list[float]], results: dict[RunKey, RunResult],
              reference: str, grid_seeds: Collection[int]) -> list[MethodSummary]:
    """A :class:`MethodSummary` per spec, in order, from the runs finished so far; the lr is
    chosen on the runs of ``grid_seeds``."""
    rows: list[MethodSummary] = []
    for spec in specs:
        grid: dict[float, Spread | None] = {}
        diverged: dict[float, int] = {}
        complete = True
        for lr in lrs[spec]:
            runs = [r for k, r in results.items() if k.spec == spec and k.lr == lr and k.seed in grid_seeds]
            grid[lr] = spread([r.val_ppl for r in runs]) if runs else None
            diverged[lr] = sum(r.diverged for r in runs)
            # every grid seed, not only one: a mean over fewer seeds is not the one the choice is made on
            complete = complete and {r.key.seed for r in runs} >= set(grid_seeds)
        row = MethodSummary(spec, grid, diverged)
        row.complete = complete
        row.chosen_lr = choose_lr(grid)
        if row.chosen_lr is not None:
            ordered = sorted(lrs[spec])
            row.at_edge = len(ordered) > 1 and row.chosen_lr in (ordered[0], ordered[-1])
            at_lr = {k.seed: r for k, r in results.items() if k.spec == spec and k.lr == row.chosen_lr}
            row.val_by_seed = {s: r.val_ppl for s, r in sorted(at_lr.items())}  # inf where diverged
            row.val = spread(list(row.val_by_seed.values()))
            row.test_by_seed = {s: (math.inf if r.diverged else r.test_ppl) for s, r in sorted(at_lr.items())
                                if r.diverged or r.test_ppl is not None}
            row.test = spread(list(row.test_by_seed.values())) if row.test_by_seed else None
        rows.append(row)
    ref = next((r for r in rows if r.spec == reference), None)
    for row in rows:
        if ref is None or row is ref:
            continue
        if ref.test_by_seed and row.test_by_seed:
            row.vs_reference = paired_difference(row.test_by_seed, ref.test_by_seed)
        if ref.val_by_seed and row.val_by_seed:
            row.val_vs_reference = paired_difference(row.val_by_seed, ref.val_by_seed)
    return rows


def _spread_json(value: Spread | None) -> dict[str, Any] | None:
    return None if value is None else {"mean": value.mean, "sd": value.sd, "n": value.n}


def _difference_json(diff: PairedDifference | None) -> dict[str, Any] | None:
    """JSON holds no inf or nan (``mean`` is then null): ``diverged`` says which side diverged."""
    if diff is None:
        return None
    out = {"mean": diff.mean, "ci95": None if diff.low is None else [diff.low, diff.high],
           "n": diff.n, "seeds": list(diff.seeds)}
    if not math.isfinite(diff.mean):
        out["diverged"] = "both" if math.isnan(diff.mean) else "this method" if diff.mean > 0 else "reference"
    return out


def summary_json(rows: Sequence[MethodSummary]) -> list[dict[str, Any]]:
    """The rows as JSON-ready dicts (``sweep.json``'s ``"methods"``)."""
    out = []
    for row in rows:
        out.append({
            "spec": row.spec,
            "val_ppl_by_lr": [{"lr": lr, "val_ppl": _spread_json(s), "diverged": row.diverged[lr]}
                              for lr, s in row.grid.items()],
            "grid_complete": row.complete,
            "chosen_lr": row.chosen_lr,
            "chosen_at_grid_edge": row.at_edge,
            "val_ppl": _spread_json(row.val),
            "test_ppl": _spread_json(row.test),
            "val_ppl_by_seed": {str(s): v for s, v in row.val_by_seed.items()},
            "test_ppl_by_seed": {str(s): v for s, v in row.test_by_seed.items()},
            "val_ppl_minus_reference": _difference_json(row.val_vs_reference),
            "test_ppl_minus_reference": _difference_json(row.vs_reference),
        })
    return out
