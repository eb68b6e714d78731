"""Transient host memory of one optimizer step of a projected matrix, by the weights' dtype and
the path the step takes: peak RSS during the step minus RSS before it, each arm in a fresh
process, side by side in one run.

    python benchmarks/matrix_step_memory.py [--rows 2048 --cols 5461 --rank 512] [--repeats 2]
        [--arms NAME ...] [--out docs/benchmarks/matrix_step_memory.json]

The matrix is an MLP weight of the paper's 1B LLaMA (2048 x 5461, rank 512) by default. Arms:

- ``fp32``: fp32 weights, the fast path (updated in place: no matrix-sized temporary);
- ``bf16``: bf16 weights, the fast path on an fp32 working copy rounded once (the default);
- ``bf16 reference``: bf16 weights through the reference path (``implementation="reference"``),
  the path every bf16 matrix took before the fast path covered them: ``S`` and the update
  formed as explicit fp32 matrices;
- ``bf16 stochastic``: the same with ``stochastic_rounding=True`` (the noise drawn a chunk at a
  time); ``bf16 stochastic, noise in one piece``: drawn for the whole matrix at once, as
  ``precision.round_into`` did before; ``bf16 stochastic, reference, noise in one piece``: both
  as before;
- ``fp32 reference``, ``fp32 frugal`` (FRUGAL's sign residual, which only the reference path
  forms) and ``fp32 galore reference``: the reference path's explicit terms for fp32 weights.

Each process builds the state with two steps, returns the heap to the OS (``malloc_trim``),
resets the peak (``/proc/self/clear_refs``) and reads ``VmHWM`` after a third step (no refresh
in it); then times :data:`STEPS_TIMED` more steps (the median). One thread. The arms' processes
run one after another, interleaved over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

#: Steps timed after the measured one (the same gradient again): their median is the step time.
STEPS_TIMED = 5
ARMS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "bf16 reference": {"dtype": "bfloat16", "implementation": "reference"},
    "bf16 stochastic": {"dtype": "bfloat16", "stochastic_rounding": True},
    "bf16 stochastic, noise in one piece": {"dtype": "bfloat16", "stochastic_rounding": True, "whole_noise": True},
    "bf16 stochastic, reference, noise in one piece": {"dtype": "bfloat16", "stochastic_rounding": True,
                                                        "implementation": "reference", "whole_noise": True},
    "fp32 reference": {"dtype": "float32", "implementation": "reference"},
    "fp32 frugal": {"dtype": "float32", "residual": "sign"},
    "fp32 galore reference": {"dtype": "float32", "residual": "drop", "implementation": "reference"},
}


def _kib(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def measure_arm(rows: int, cols: int, rank: int, arm: dict) -> dict:
    """One arm in this process: the step's transient in bytes and per element of the matrix."""
    import ctypes

    import torch

    from fira_optim import FiraAdamW, precision

    torch.set_num_threads(1)
    if arm.get("whole_noise"):
        precision.ROUNDING_CHUNK = 1 << 40
    dtype = getattr(torch, arm["dtype"])
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter((torch.randn(rows, cols, generator=g) * 0.02).to(dtype))
    opt = FiraAdamW([{"params": [w], "rank": rank, "update_proj_gap": 10**6}], lr=1e-3, weight_decay=0.1,
                    implementation=arm.get("implementation", "fast"),
                    stochastic_rounding=arm.get("stochastic_rounding", False),
                    residual=arm.get("residual", "add"))
    for _ in range(2):  # the refresh, the states, first touch of all that persists
        w.grad = (torch.randn(rows, cols, generator=g) * 1e-3).to(dtype)
        opt.step()
    w.grad = (torch.randn(rows, cols, generator=g) * 1e-3).to(dtype)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the heap back to the OS: RSS is the live data
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as refs:
        refs.write("5")  # VmHWM := VmRSS
    before = _kib("VmRSS")
    opt.step()
    transient = (_kib("VmHWM") - before) * 1024
    seconds = []
    for _ in range(STEPS_TIMED):
        start = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - start)
    return {"transient_bytes": transient, "bytes_per_element": transient / (rows * cols),
            "step_seconds": statistics.median(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=5461)
    parser.add_argument("--rank", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per arm (interleaved)")
    parser.add_argument("--arms", nargs="+", metavar="NAME",
                        help=f"the arms to run, each quoted (default: all: {'; '.join(ARMS)})")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in a child process
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(measure_arm(args.rows, args.cols, args.rank, ARMS[args.arm])))
        return
    arms = ARMS
    if args.arms:
        unknown = [name for name in args.arms if name not in ARMS]
        if unknown:
            parser.error(f"--arms: unknown arm(s) {', '.join(map(repr, unknown))}; the arms: {'; '.join(ARMS)}")
        arms = {name: ARMS[name] for name in args.arms}
    from record import machine, provenance, save

    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name in arms:  # arms interleaved: the machine's state drifts alike for all
            child = [sys.executable, __file__, "--arm", name, "--rows", str(args.rows), "--cols",
                     str(args.cols), "--rank", str(args.rank)]
            result = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
            runs[name].append(result)
            print(f"{name:48s} {result['transient_bytes'] / 2**20:8.1f} MiB  "
                  f"{result['bytes_per_element']:5.1f} bytes per element  "
                  f"step {1e3 * result['step_seconds']:6.1f} ms", flush=True)
    result = {
        **provenance(), "machine": machine("one thread per process"),
        "matrix": [args.rows, args.cols], "rank": args.rank, "arms": arms,
        "transient_bytes_per_element": {name: [r["bytes_per_element"] for r in rows] for name, rows in runs.items()},
        "transient_bytes": {name: [r["transient_bytes"] for r in rows] for name, rows in runs.items()},
        "median_step_seconds": {name: [r["step_seconds"] for r in rows] for name, rows in runs.items()},
    }
    save(result, args.out)


if __name__ == "__main__":
    main()
