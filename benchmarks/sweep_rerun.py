"""One method's runs in two sweep folders, seed by seed: a rerun (other code, another machine)
against the runs it repeats.

    python benchmarks/sweep_rerun.py docs/results/tiny-exact-norm docs/results/tiny-sweep-galore-raw \
        --spec fira --lr 0.02 --out docs/results/tiny-exact-norm/rerun-fira.md

Reads each folder's ``sweep.json`` (as ``fira-train sweep`` writes it), takes the runs of
``--spec`` at ``--lr`` and writes, for validation and test perplexity, each seed's value in both
and the paired difference ``rerun - earlier`` (mean and Student-t 95% interval over the seeds both
ran, as the sweep's own reports compute it), also relative to the earlier value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fira_train.sweep.report import read_runs
from fira_train.sweep.stats import paired_difference


def seed_values(folder: Path, spec: str, lr: float) -> dict[str, dict[int, float]]:
    """``{"val": {seed: ppl}, "test": {seed: ppl}}`` of ``spec``'s runs at ``lr`` in ``folder``."""
    path = folder / "sweep.json"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: give a folder fira-train sweep wrote")
    runs = [r for key, r in read_runs(json.loads(path.read_text())).items() if key.spec == spec and key.lr == lr]
    if not runs:
        raise SystemExit(f"{path} holds no run of {spec!r} at lr {lr}")
    return {"val": {r.key.seed: r.val_ppl for r in runs},  # inf: diverged
            "test": {r.key.seed: r.test_ppl for r in runs if r.test_ppl is not None}}  # None: no test split


def compare(rerun: Path, earlier: Path, spec: str, lr: float) -> str:
    """The markdown table of both folders' runs and their paired differences."""
    new, old = seed_values(rerun, spec, lr), seed_values(earlier, spec, lr)
    lines = [f"`{spec}` at lr {lr}: {rerun} (rerun) against {earlier} (earlier), perplexity by seed.", "",
             "| Split | Seed | Earlier | Rerun | Rerun - earlier | Relative |", "|---|---|---|---|---|---|"]
    for split in ("val", "test"):
        for seed in sorted(new[split].keys() & old[split].keys()):
            a, b = old[split][seed], new[split][seed]
            lines.append(f"| {split} | {seed} | {a:.2f} | {b:.2f} | {b - a:+.2f} | {(b - a) / a:+.1%} |")
    lines += ["", "| Split | Paired difference, rerun - earlier (95% interval) | Seeds |", "|---|---|---|"]
    for split in ("val", "test"):
        d = paired_difference(new[split], old[split])
        if d is None:
            lines.append(f"| {split} | {'no seed in both' if new[split] and old[split] else 'no test split'} | - |")
            continue
        interval = (f" [{d.low:+.2f}, {d.high:+.2f}]" if d.low is not None else " (one seed: no interval)"
                    if d.n < 2 else " (a run diverged: no interval)")
        lines.append(f"| {split} | {d.mean:+.2f}{interval} | {', '.join(map(str, d.seeds))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rerun", type=Path)
    parser.add_argument("earlier", type=Path)
    parser.add_argument("--spec", required=True, help="the method spec, as the sweeps name it")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    text = compare(args.rerun, args.earlier, args.spec, args.lr)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
