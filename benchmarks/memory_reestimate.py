"""Today's estimate beside measured peaks recorded earlier by ``fira-train memory --measure``.

    python benchmarks/memory_reestimate.py docs/results/memory-measured/gpu-bf16 \
        train.batch_size=1 train.micro_batch_size=1 train.param_dtype=bfloat16

Reads ``DIR/<size>/memory.json`` and, for every row of a method the estimate models (not
LoRA's), rebuilds its run config (the recipe named
by the directory's record, the row's method spec, then the overrides given here, which must be
the ones the measurement used) and prints the estimate of the day it was measured, today's
estimate (:func:`fira_train.memory.run_estimate.estimate_run_bytes` on the row's device) and
measured / today's estimate. The measurements are not touched: ``memory.json`` keeps the
estimate of its day.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fira_train.config.method_spec import parse_method_specs
from fira_train.config.overrides import apply_overrides
from fira_train.config.recipes import get_recipe
from fira_train.memory.run_estimate import estimate_run_bytes, is_estimated


def reestimate(root: Path, overrides: list[str]) -> list[dict]:
    """One dict per measured row: size, method, measured, estimate then and now (bytes)."""
    out = []
    records = [(path.parent.name, json.loads(path.read_text())) for path in sorted(root.glob("*/memory.json"))]
    def parameters(item: tuple[str, dict]) -> int:  # smallest model first
        rows = item[1]["rows"]
        return rows[0]["measured"]["parameters"] if rows else 0

    for folder, record in sorted(records, key=parameters):
        base = apply_overrides(get_recipe(record["recipe"]), overrides)
        # the folder names the measurement where it is not the size (before / after a change)
        size = record["recipe"] if folder == record["recipe"] else f"{record['recipe']} ({folder})"
        for row in record["rows"]:
            config = parse_method_specs(row["method"])[0].config(base, ".")
            if not is_estimated(config.optim.method):  # LoRA's rows: measured, never estimated
                continue
            now = estimate_run_bytes(config, row["measured"]["vocab_size"], row["measured"]["device"])
            out.append({"size": size, "method": row["method"],
                        "measured": row["measured_peak_bytes"], "then": row["estimated_bytes"],
                        "now": now["total"]})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("overrides", nargs="*", help="key=value, as the measurement's command had them")
    args = parser.parse_args(argv)
    rows = reestimate(args.root, args.overrides)
    if not rows:
        raise SystemExit(f"no */memory.json under {args.root}")
    gib = 2**30
    print("| Size | Method | Measured | Estimate then | Estimate now | Measured / now |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['method']} | {r['measured'] / gib:.2f} GiB | {r['then'] / gib:.2f} GiB "
              f"| {r['now'] / gib:.2f} GiB | {r['measured'] / r['now']:.2f} |")


if __name__ == "__main__":
    main()
