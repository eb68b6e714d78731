"""Summarise ``fira-train memory --measure`` results of several model sizes in one table.

    python benchmarks/memory_summary.py docs/results/memory-measured

Reads ``DIR/<size>/memory.json`` (one per size, as ``fira-train memory --measure --out
DIR/<size>`` writes them) and writes ``DIR/summary.md``: the measured peak of every method spec
at every size, as bytes and as a fraction of AdamW's measured peak at that size, and the
measured / estimated ratio. Numbers come from the JSON files only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def summarise(root: Path) -> str:
    records = {p.parent.name: json.loads(p.read_text()) for p in sorted(root.glob("*/memory.json"))}
    if not records:
        raise SystemExit(f"no */memory.json under {root}")
    sizes = sorted(records, key=lambda s: records[s]["rows"][0]["measured"]["parameters"])
    methods = list(dict.fromkeys(r["method"] for s in sizes for r in records[s]["rows"]))
    lines = ["# Measured peak memory by model size", "",
             "Peak memory of a few training steps of each method, measured by `fira-train memory "
             "--measure` (each method in a fresh process; see each size's `memory.md` for the "
             "command, the machine and the date). In parentheses: the fraction of AdamW's measured "
             "peak at that size; then measured / estimated.", "",
             "| Method | " + " | ".join(f"{s} ({records[s]['rows'][0]['measured']['parameters'] / 1e6:.0f}M)"
                                     for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for method in methods:
        cells = []
        for size in sizes:
            rows = {r["method"]: r for r in records[size]["rows"]}
            row, adamw = rows.get(method), rows.get("adamw")
            if row is None:
                cells.append("-")
                continue
            peak = row["measured_peak_bytes"]
            share = f" ({100 * peak / adamw['measured_peak_bytes']:.0f}%)" if adamw else ""
            cells.append(f"{_gib(peak)}{share}; {peak / row['estimated_bytes']:.2f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    args = parser.parse_args()
    text = summarise(args.root)
    (args.root / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
