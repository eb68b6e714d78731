"""A refresh step of FiraAdamW on a GPU: SVDs by cuSOLVER vs on the host (``host_refresh=True``).

    python benchmarks/refresh_host.py --sizes tiny,60m,130m --out docs/benchmarks/refresh_host_cuda.json

For each size, the projected matrices of that recipe's LLaMA, at its rank (4 attention matrices of
d x d and three MLP matrices of d x ffn per layer; ``tiny`` is the CPU recipe, the others the
paper's),
as CUDA parameters with gradients of a decaying spectrum (the projection of Gaussian noise is
ill-defined: its singular values have no gap at r). Two optimizers, ``host_refresh`` False and
True, take turns doing steps that refresh every basis (``update_proj_gap=1``); the median step
time of each is reported, and how far apart their subspaces are (the largest spectral norm of
``P P^T - P' P'^T`` over the matrices, after one step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from fira_optim import FiraAdamW
from fira_train.config.recipes import get_recipe
from record import provenance, save

#: The recipes whose shapes it takes (fira_train's: d_model, MLP width, layers and rank).
SIZES = ("tiny", "60m", "130m", "350m")


def recipe_shapes(name: str) -> tuple[list[tuple[int, int]], int]:
    """The projected matrices of a recipe's LLaMA (q, k, v, o, gate, up, down per layer) and its rank."""
    config = get_recipe(name)
    d, ffn, layers = config.model.hidden_size, config.model.intermediate_size, config.model.num_hidden_layers
    return [(d, d)] * 4 * layers + [(ffn, d)] * 2 * layers + [(d, ffn)] * layers, config.optim.rank


def decaying(m: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """An ``m x n`` matrix with singular values exp(-i / 30)."""
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=generator))
    return (u * torch.exp(-torch.arange(k) / 30.0)) @ v.T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,60m")
    parser.add_argument("--steps", type=int, default=3, help="timed refresh steps per optimizer")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device: on the CPU the refresh already runs on the host")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {list(SIZES)}")
    results = {}
    for size in sizes:
        shapes, rank = recipe_shapes(size)
        gen = torch.Generator().manual_seed(0)
        grads = {s: decaying(*s, gen).cuda() for s in set(shapes)}
        runs = {}
        for host in (False, True):
            params = [torch.nn.Parameter(torch.zeros(s, device="cuda")) for s in shapes]
            opt = FiraAdamW([{"params": params, "rank": rank}], lr=1e-3, update_proj_gap=1, host_refresh=host)
            runs[host] = (params, opt, [])
        for turn in range(args.steps + 1):  # the first step of each is a warm-up
            for host, (params, opt, times) in runs.items():
                for p, s in zip(params, shapes):
                    p.grad = grads[s]
                torch.cuda.synchronize()
                start = time.perf_counter()
                opt.step()
                torch.cuda.synchronize()
                if turn:
                    times.append(time.perf_counter() - start)
        apart = 0.0
        for p, q in zip(runs[False][0], runs[True][0]):
            a, b = runs[False][1].state[p]["basis"], runs[True][1].state[q]["basis"]
            apart = max(apart, float(torch.linalg.matrix_norm(a @ a.T - b @ b.T, ord=2)))
        results[size] = {
            "matrices": len(shapes), "rank": rank,
            "step_seconds_median": {"cusolver": statistics.median(runs[False][2]),
                                    "host_refresh": statistics.median(runs[True][2])},
            "max_projector_distance": apart,
        }
        print(size, json.dumps(results[size]), flush=True)
    out = {
        **provenance(),
        "machine": f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPUs ({platform.machine()}), "
                   f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        "sizes": results,
    }
    save(out, args.out)


if __name__ == "__main__":
    main()
