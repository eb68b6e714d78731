"""How far bf16 second moments drift from fp32 ones, rounded to nearest and stochastically, and
what stochastic rounding costs per step.

    python benchmarks/bf16_state_rounding.py [--out docs/benchmarks/bf16_state_rounding.json]

Tracking: a 16 x 256 matrix projected at rank 4 (its ``v`` is that of ``R``, 4 x 256) and a
plain 1024-element vector, under Gaussian gradients of scale 1 for 1500 steps, then of scale 0.3
for 1000 (betas 0.9, 0.999), with fp32 states and with bf16 states rounded each way (the same
gradients: they do not depend on the weights). Every 100 steps from step 500: the mean over the
entries of ``|v - v_fp32| / v_fp32``, and the ratio of the means of ``v`` and ``v_fp32``; the
numbers quoted under "Memory" in docs/optimizer.md come from this script.

Cost: the median time of an optimizer step (one thread, after 3 warm-up steps) of a plain
4096 x 256 parameter (1M elements: one chunk of the unprojected path) and of a 1024 x 1024
matrix projected at rank 128, with bf16 states rounded each way.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fira_optim import FiraAdamW
from record import machine, provenance, save

STEPS, DROP, SAMPLE_FROM = 2500, 1500, 500


def _tracked(**options) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    matrix, vector = torch.nn.Parameter(torch.zeros(16, 256)), torch.nn.Parameter(torch.zeros(1024))
    opt = FiraAdamW([{"params": [matrix], "rank": 4, "update_proj_gap": 10**6}, {"params": [vector]}],
                    lr=1e-3, **options)
    tracked = []
    for k in range(STEPS):
        scale = 1.0 if k < DROP else 0.3
        matrix.grad = torch.randn(16, 256, generator=g) * scale
        vector.grad = torch.randn(1024, generator=g) * scale
        opt.step()
        if k >= SAMPLE_FROM and k % 100 == 99:
            tracked.append([opt.state[p]["exp_avg_sq"].float().clone() for p in (matrix, vector)])
    return tracked


def tracking() -> dict:
    exact = _tracked()
    out = {}
    for rounding in ("nearest", "stochastic"):
        got = _tracked(state_dtype="bfloat16", state_rounding=rounding)
        for i, name in enumerate(("projected", "plain")):
            errors = [float(((a[i] - b[i]).abs() / b[i]).mean()) for a, b in zip(got, exact)]
            ratios = [float(a[i].mean() / b[i].mean()) for a, b in zip(got, exact)]
            out[f"{rounding}, {name}"] = {
                "mean_relative_error": statistics.fmean(errors), "largest_relative_error": max(errors),
                "ratio_of_means_min": min(ratios), "ratio_of_means_max": max(ratios),
                "relative_error_per_sample": errors}
    return out


def step_seconds(rounding: str, projected: bool, steps: int = 20) -> float:
    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn((1024, 1024) if projected else (4096, 256), generator=g))
    group = {"params": [param], "rank": 128, "update_proj_gap": 10**6} if projected else {"params": [param]}
    opt = FiraAdamW([group], lr=1e-3, state_dtype="bfloat16", state_rounding=rounding)
    times = []
    for k in range(steps + 3):
        param.grad = torch.randn(param.shape, generator=g)
        start = time.perf_counter()
        opt.step()
        if k >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = tracking()
    for name, row in result.items():
        print(f"{name}: mean relative error of v {row['mean_relative_error']:.3f} (largest "
              f"{row['largest_relative_error']:.3f}), mean v / mean v_fp32 in [{row['ratio_of_means_min']:.3f}, "
              f"{row['ratio_of_means_max']:.3f}]")
    seconds = {f"{rounding}, {kind}": step_seconds(rounding, kind == "projected 1024 x 1024 at rank 128")
               for kind in ("plain 4096 x 256", "projected 1024 x 1024 at rank 128")
               for rounding in ("nearest", "stochastic")}
    for name, value in seconds.items():
        print(f"{name}: {1e3 * value:.2f} ms per step")
    save({**provenance(), "machine": machine("torch on one thread"), "steps": STEPS, "drop_at": DROP,
          "tracking": result, "median_step_seconds": seconds}, args.out)


if __name__ == "__main__":
    main()
