"""How often, and how badly, the fast path's column-norm ||S|| loses precision in pre-training.

    python benchmarks/residual_precision.py [--steps 8] [--out docs/benchmarks/residual_precision.json]

Trains ``tiny`` (its recipe: rank 64, T = 6) with Fira for ``--steps`` steps and, at every step,
records for each projected matrix ``||S|| / ||phi G||`` and, where
:func:`fira_optim.residual.cancelled` flags it, the relative error of the subtraction's ``||S||``
against the explicit norm that replaces it. Prints one line per step. The numbers quoted under
"Speed" in docs/optimizer.md come from this script.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import fira_optim.pipeline as pipeline
from fira_train.config.overrides import apply_overrides
from fira_train.config.recipes import get_recipe
from fira_train.run.train import train
from record import machine, provenance, save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", help="write the per-step records as JSON here")
    args = parser.parse_args()
    steps: list[tuple[list[float], list[float]]] = []
    exact_where_cancelled = pipeline.exact_where_cancelled

    def recording(norms, wholes, *rest, **kwargs):
        exact = exact_where_cancelled(norms, wholes, *rest, **kwargs)
        ratios = (norms / wholes).tolist()
        errors = [abs(a - b) / b for a, b in zip(norms.tolist(), exact.tolist()) if a != b]
        steps.append((ratios, errors))
        return exact

    pipeline.exact_where_cancelled = recording
    with tempfile.TemporaryDirectory() as out:
        config = apply_overrides(get_recipe("tiny"), [
            "optim.method=fira", f"train.steps={args.steps}", f"train.out_dir={out}", "train.progress=false",
            "train.tensorboard=false", "train.eval_every=0", "train.save_every=0"])
        train(config, overwrite=True)
    total = sum(len(errors) for _, errors in steps)
    print(f"{total} of {sum(len(r) for r, _ in steps)} matrix steps formed S explicitly")
    records = []
    for step, (ratios, errors) in enumerate(steps, start=1):
        record = {"step": step, "matrices": len(ratios), "ratio_median": statistics.median(ratios),
                  "ratio_min": min(ratios), "explicit": len(errors),
                  "error_median": statistics.median(errors) if errors else None,
                  "error_max": max(errors) if errors else None}
        records.append(record)
        line = (f"step {step}: {len(ratios)} matrices, ||S||/||phi G|| median {record['ratio_median']:.4f} "
                f"min {record['ratio_min']:.4f}; explicit {len(errors)}")
        if errors:
            line += f", subtraction's error median {record['error_median']:.2e} max {record['error_max']:.2e}"
        print(line)
    save({**provenance(), "machine": machine(),
          "recipe": "tiny", "steps": records}, args.out)


if __name__ == "__main__":
    main()
