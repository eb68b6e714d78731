"""Per-example correctness of fine-tuning runs, and the paired comparison of two runs on the same examples.

A run writes ``predictions/<task>.jsonl`` (one line per test example: its ``index`` in the test
file and whether it was answered ``correct``); :func:`load_correctness` reads them back and
:func:`compare` pairs two runs example by example (McNemar's exact test,
:func:`fira_train.finetune.stats.mcnemar_exact`). Runs are comparable only when they scored the
same examples (same ``--max-eval`` and ``--seed``): anything else is an error, not a silently
smaller comparison.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fira_train.files import read_json_lines
from fira_train.finetune.stats import mcnemar_exact

__all__ = ["Paired", "load_correctness", "compare", "pool"]


@dataclass(frozen=True)
class Paired:
    """Run B against run A on the same n examples."""

    n: int
    both: int
    only_a: int
    """Examples A answers correctly and B does not."""
    only_b: int
    neither: int

    @property
    def difference(self) -> float:
        """Accuracy of B minus accuracy of A (a fraction): ``(only_b - only_a) / n``."""
        return (self.only_b - self.only_a) / self.n if self.n else 0.0

    @property
    def p_value(self) -> float:
        """Two-sided exact McNemar p-value."""
        return mcnemar_exact(self.only_a, self.only_b)


def load_correctness(run_dir: str | Path, tasks: list[str] | None = None) -> dict[str, dict[int, bool]]:
    """``{task: {index: correct}}`` from ``run_dir/predictions/<task>.jsonl`` (every task there, or ``tasks``)."""
    folder = Path(run_dir) / "predictions"
    names = tasks if tasks is not None else sorted(p.stem for p in folder.glob("*.jsonl"))
    out: dict[str, dict[int, bool]] = {}
    for name in names:
        path = folder / f"{name}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the run in {run_dir} has no predictions for {name}")
        rows = read_json_lines(path)  # a line that is no JSON: DamagedFileError naming it
        if any(not isinstance(row, dict) or not isinstance(row.get("index"), int) or "correct" not in row
               for row in rows):
            raise ValueError(f"{path} has lines without 'index' and 'correct' (written by an older version, "
                             f"or damaged): rerun that configuration to pair it with others")
        out[name] = {row["index"]: bool(row["correct"]) for row in rows}
        if len(out[name]) != len(rows):
            raise ValueError(f"{path} lists an example index twice")
    return out


def compare(a: Mapping[int, bool], b: Mapping[int, bool], what: str = "") -> Paired:
    """Pair ``a`` and ``b`` (``{index: correct}`` of two runs) on their examples, which must be the same."""
    if a.keys() != b.keys():
        only = sorted(set(a) ^ set(b))
        raise ValueError(f"{what or 'the runs'} scored different examples ({len(a)} and {len(b)}; e.g. index "
                         f"{only[0]} is in one only): pair runs with the same --max-eval and --seed")
    counts = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
    for index, correct in a.items():
        counts[(correct, b[index])] += 1
    return Paired(n=len(a), both=counts[(True, True)], only_a=counts[(True, False)], only_b=counts[(False, True)],
                  neither=counts[(False, False)])


def pool(pairs: list[Paired]) -> Paired:
    """The examples of several comparisons together (e.g. all tasks: each example counts once)."""
    return Paired(n=sum(p.n for p in pairs), both=sum(p.both for p in pairs), only_a=sum(p.only_a for p in pairs),
                  only_b=sum(p.only_b for p in pairs), neither=sum(p.neither for p in pairs))
