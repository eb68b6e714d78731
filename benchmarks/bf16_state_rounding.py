"""How far bf16 second moments drift from fp32 ones, rounded to nearest and stochastically, and
what stochastic rounding costs per step.

    python benchmarks/bf16_state_rounding.py [--out docs/benchmarks/bf16_state_rounding.json]

Tracking: a 16 x 256 matrix projected at rank 4 (its ``v`` is that of ``R``, 4 x 256) and a
plain 8192-element vector, under Gaussian gradients of scale 1 for 1500 steps, then of scale 0.3
for 1000 (betas 0.9, 0.999), with fp32 states, with bf16 states rounded each way, and with int8
states (the vector's only: ``R`` is below int8's smallest quantized moment; the same gradients
throughout: they do not depend on the weights). Every 100 steps from step 500: the mean over the
entries of ``|v - v_fp32| / v_fp32``, and the ratio of the means of ``v`` and ``v_fp32``; the
numbers quoted under "Memory" in docs/optimizer.md come from this script.

Cost: the median time of 50 optimizer steps (one thread, after 3 warm-up steps and a discarded
measurement: a process's first steps ran up to 3 times slower; the two roundings' steps
interleaved) of a plain 4096 x 256 parameter (1M elements: one chunk of the unprojected path) and of a
1024 x 1024 matrix projected at rank 128, with bf16 states rounded each way; and, side by side,
the median time of drawing 1M 16-bit random numbers as the rounding does
(``precision.uniform_bits16``: four per 64-bit draw) and one per draw (``torch.randint``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fira_optim import FiraAdamW
from fira_optim.precision import decode, uniform_bits16
from record import machine, provenance, save

STEPS, DROP, SAMPLE_FROM = 2500, 1500, 500
ROUNDINGS = ("nearest", "stochastic")
#: Elements of the plain vector: enough for int8 codes (4096 and more)
VECTOR = 8192


def _tracked(**options) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    matrix, vector = torch.nn.Parameter(torch.zeros(16, 256)), torch.nn.Parameter(torch.zeros(VECTOR))
    opt = FiraAdamW([{"params": [matrix], "rank": 4, "update_proj_gap": 10**6}, {"params": [vector]}],
                    lr=1e-3, **options)
    tracked = []
    for k in range(STEPS):
        scale = 1.0 if k < DROP else 0.3
        matrix.grad = torch.randn(16, 256, generator=g) * scale
        vector.grad = torch.randn(VECTOR, generator=g) * scale
        opt.step()
        if k >= SAMPLE_FROM and k % 100 == 99:
            tracked.append([decode(opt.state[p], ["exp_avg_sq"], torch.float32)["exp_avg_sq"].clone()
                            for p in (matrix, vector)])
    return tracked


def tracking() -> dict:
    exact = _tracked()
    out = {}
    settings = {"nearest": {"state_dtype": "bfloat16"},
                "stochastic": {"state_dtype": "bfloat16", "state_rounding": "stochastic"},
                "int8": {"state_dtype": "int8"}}
    for setting, options in settings.items():
        got = _tracked(**options)
        # int8: R's 1024 elements are below the quantized size, kept in fp32
        kinds = {"plain": 1} if setting == "int8" else {"projected": 0, "plain": 1}
        for name, i in kinds.items():
            errors = [float(((a[i] - b[i]).abs() / b[i]).mean()) for a, b in zip(got, exact)]
            ratios = [float(a[i].mean() / b[i].mean()) for a, b in zip(got, exact)]
            out[f"{setting}, {name}"] = {
                "mean_relative_error": statistics.fmean(errors), "largest_relative_error": max(errors),
                "ratio_of_means_min": min(ratios), "ratio_of_means_max": max(ratios),
                "relative_error_per_sample": errors}
    return out


def noise_seconds(repeats: int = 50) -> dict[str, float]:
    """Median seconds to draw 1M random integers in [0, 2^16), each way."""
    g, n = torch.Generator().manual_seed(0), 1 << 20
    draws = {"uniform_bits16 (four per 64-bit draw)": lambda: uniform_bits16(n, g),
             "torch.randint (one per draw)": lambda: torch.randint(0, 1 << 16, (n,), generator=g, dtype=torch.int32)}
    times = {name: [] for name in draws}
    for _ in range(repeats + 3):  # interleaved, so that both see the same load
        for name, draw in draws.items():
            start = time.perf_counter()
            draw()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[3:]) for name, t in times.items()}


def step_seconds(projected: bool, steps: int = 50) -> dict[str, float]:
    """Median seconds of a step with bf16 states rounded each way: one optimizer per rounding,
    their steps interleaved, so that both see the same load and the same state of the allocator
    (which, step after step, made the same step take 3 ms or 7-11)."""
    g = torch.Generator().manual_seed(0)
    shape = (1024, 1024) if projected else (4096, 256)
    runs = {}
    for rounding in ROUNDINGS:
        param = torch.nn.Parameter(torch.randn(shape, generator=g))
        group = {"params": [param], "rank": 128, "update_proj_gap": 10**6} if projected else {"params": [param]}
        runs[rounding] = (param, FiraAdamW([group], lr=1e-3, state_dtype="bfloat16", state_rounding=rounding))
    times = {rounding: [] for rounding in ROUNDINGS}
    for k in range(steps + 3):
        grad = torch.randn(shape, generator=g)
        for rounding, (param, opt) in runs.items():
            param.grad = grad.clone()
            start = time.perf_counter()
            opt.step()
            if k >= 3:
                times[rounding].append(time.perf_counter() - start)
    return {rounding: statistics.median(t) for rounding, t in times.items()}


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
    step_seconds(False, steps=5)  # discarded: a process's first steps ran up to 3 times slower
    seconds = {f"{rounding}, {kind}": value
               for kind in ("plain 4096 x 256", "projected 1024 x 1024 at rank 128")
               for rounding, value in step_seconds(kind != "plain 4096 x 256").items()}
    for name, value in seconds.items():
        print(f"{name}: {1e3 * value:.2f} ms per step")
    noise = noise_seconds()
    for name, value in noise.items():
        print(f"1M random 16-bit numbers, {name}: {1e3 * value:.2f} ms")
    save({**provenance(), "machine": machine("torch on one thread"), "steps": STEPS, "drop_at": DROP,
          "tracking": result, "median_step_seconds": seconds,
          "median_seconds_per_million_16_bit_numbers": noise}, args.out)


if __name__ == "__main__":
    main()
