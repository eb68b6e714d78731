"""Benchmark: what an allocator setting costs in training speed, measured in alternating processes.

    python benchmarks/allocator_speed.py --recipe tiny --methods adamw,fira --pairs 4 --rounds 3 \
        --env MALLOC_MMAP_THRESHOLD_=131072 --out docs/benchmarks/allocator_tiny.json

glibc reads its ``MALLOC_*`` variables once, when the process starts, so one process cannot
time both settings. This script runs ``benchmarks/throughput.py`` (every method of ``--methods``
on the same batches, taking turns) ``2 * --pairs`` times, alternately without and with ``--env``,
the order swapped in every other pair (AB, BA, AB, ...) so that a drift of the machine's speed
hits both settings alike. For each method and pair it takes

    ratio_i = tokens/s with the setting / tokens/s without it

(each process's median over its rounds) and reports the mean ratio with a 95% Student's t
interval over the pairs, and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fira_train.analysis.runs import machine_description
from fira_train.sweep.stats import mean_interval
from record import provenance, save

HERE = Path(__file__).resolve().parent


def parse_env(text: str, parser: argparse.ArgumentParser) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not name.replace("_", "").isalnum():
        parser.error(f"--env {text!r}: expected NAME=VALUE, e.g. MALLOC_MMAP_THRESHOLD_=131072")
    return name, value


def timed(args: argparse.Namespace, env: dict[str, str], label: str) -> dict[str, float]:
    """One throughput.py process: each method's median tokens/s over its rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "throughput.json"
        argv = [sys.executable, str(HERE / "throughput.py"), "--recipe", args.recipe, "--methods", args.methods,
                "--rounds", str(args.rounds), "--out", str(out), *args.overrides]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        print(f"[{label}] {' '.join(argv)}", flush=True)
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["tokens_per_s_median"]


def alternate(pairs: int, name: str, value: str, time_one) -> list[dict]:
    """``time_one(env, label)`` in ``2 * pairs`` processes, without and with ``name=value`` in
    the environment, in the order AB, BA, AB, ... (a drift of the machine hits both alike)."""
    without = {k: v for k, v in os.environ.items() if k != name}
    settings = [("without", without), ("with", without | {name: value})]
    runs = []
    for i in range(pairs):
        for label, env in (settings if i % 2 == 0 else settings[::-1]):
            runs.append({"pair": i, "setting": label, "tokens_per_s": time_one(env, f"pair {i}, {label}")})
    return runs


def summarize(runs: list[dict], pairs: int) -> dict[str, dict]:
    """Per method: the ratios with / without of each pair, their mean with its 95% interval, and
    their median."""
    summary = {}
    for m in runs[0]["tokens_per_s"]:
        speed = {label: {r["pair"]: r["tokens_per_s"][m] for r in runs if r["setting"] == label}
                 for label in ("without", "with")}
        ratios = [speed["with"][i] / speed["without"][i] for i in range(pairs)]
        mean, low, high = mean_interval(ratios)
        summary[m] = {"ratio_mean": mean, "ratio_low": low, "ratio_high": high,
                      "ratio_median": statistics.median(ratios), "ratios": ratios}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--methods", default="adamw,fira", help="throughput.py's --methods (adamw first)")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="throughput.py's rounds per process")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--env", default="MALLOC_MMAP_THRESHOLD_=131072", help="the setting, NAME=VALUE")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every method")
    args = parser.parse_args()
    if args.pairs < 2:
        parser.error(f"--pairs {args.pairs}: at least 2 (an interval needs two pairs)")
    name, value = parse_env(args.env, parser)
    runs = alternate(args.pairs, name, value, lambda env, label: timed(args, env, label))
    summary = summarize(runs, args.pairs)
    for m, s in summary.items():
        print(f"{m}: with {args.env} / without = {s['ratio_mean']:.3f} [{s['ratio_low']:.3f}, "
              f"{s['ratio_high']:.3f}] (mean, 95% interval over {args.pairs} pairs; median "
              f"{s['ratio_median']:.3f})", flush=True)
    save({**provenance(), "machine": machine_description(), "setting": args.env, "recipe": args.recipe,
          "rounds": args.rounds, "runs": runs, "summary": summary}, args.out)


if __name__ == "__main__":
    main()
