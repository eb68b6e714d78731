"""One exact-SVD refresh of every projected matrix of a recipe, on the CPU, by route and threading.

    python benchmarks/refresh_threads.py --recipe tiny --rounds 9 --out docs/benchmarks/refresh_tiny.json

Takes the weight gradients of the recipe's model after a few Fira training steps on the
embedded corpus (the harness's own step), then times one refresh of all of them -- the SVDs
that ``FiraAdamW`` runs at a refresh step -- in these configurations, taking turns, median
over rounds:

- ``sequential``: one matrix after another, every torch thread per SVD;
- ``pool, all threads per worker`` / ``pool, 1 thread per worker``: a pool of
  ``torch.get_num_threads()`` workers, each left at the default (MKL's LAPACK opens an OpenMP
  team of every core in each worker, and the teams oversubscribe the cores) or set to one
  intra-op thread as it starts;
- each with the SVD route of :func:`fira_optim.projection.svd_basis`: ``tall`` (the tall
  orientation, plain SVD) or ``QR first`` (the small side's vectors from the R factor, taken
  where the signs are aligned, ``align_signs=True``).

``FiraAdamW`` uses ``pool, 1 thread per worker, tall`` when several matrices are due (``QR first``
with ``align_signs=True``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import fira_optim.projection as projection
from fira_optim.projection import projection_side, svd_basis
from fira_train.config.overrides import apply_overrides
from fira_train.config.recipes import get_recipe
from fira_train.data.build import build_corpus
from fira_train.run.train import train_step
from fira_train.run.training import autocast_for, build_training, resolve_device
from record import machine, provenance, save


def gradients(recipe: str, steps: int, overrides: list[str]) -> tuple[list[torch.Tensor], int, str]:
    """The projected matrices' gradients after ``steps`` Fira steps, the rank, the proj_type."""
    config = apply_overrides(get_recipe(recipe), ["optim.method=fira", "train.tensorboard=false", *overrides])
    corpus = build_corpus(config.data)
    device = resolve_device(config)
    training = build_training(config, corpus.vocab_size, device)
    micro = config.train.micro_batch
    stream = corpus.train_batches(micro, config.train.seed)
    autocast = autocast_for(config, device)
    for step in range(1, steps + 1):
        train_step(training, config, stream, autocast, step)
    ids = next(stream).to(device)
    training.model(input_ids=ids, labels=ids).loss.backward()
    optimizer = training.optimizer
    grads = [p.grad.detach().clone() for g in optimizer.param_groups if g.get("rank") is not None
             for p in g["params"] if p.ndim == 2 and p.grad is not None]
    group = next(g for g in optimizer.param_groups if g.get("rank") is not None)
    return grads, group["rank"], group["proj_type"]


def refresh(grads: list[torch.Tensor], rank: int, proj_type: str, *, workers: int, worker_threads: int,
            qr_first: bool) -> float:
    """Seconds for one refresh of every gradient."""
    threads = torch.get_num_threads()
    ratio = projection.QR_FIRST_RATIO if qr_first else math.inf

    def basis(grad: torch.Tensor) -> torch.Tensor:
        return svd_basis(grad, rank, projection_side(grad.shape, proj_type), fast_route=True,
                         qr_first_ratio=ratio)

    try:
        start = time.perf_counter()
        if workers == 1:
            for grad in grads:
                basis(grad)
        elif worker_threads == 1:  # as FiraAdamW: each worker sets one thread as it starts
            with ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
                list(pool.map(basis, grads))
        else:  # each worker at the default: an OpenMP team of every core in each LAPACK call
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(basis, grads))
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--steps", type=int, default=3, help="Fira steps before the gradients are taken")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = parser.parse_args()
    grads, rank, proj_type = gradients(args.recipe, args.steps, list(args.overrides))
    threads = torch.get_num_threads()
    configs = {}
    for route, qr_first in (("tall", False), ("QR first", True)):
        configs[f"sequential, {route}"] = dict(workers=1, worker_threads=threads, qr_first=qr_first)
        if threads > 1:
            configs[f"pool, all threads per worker, {route}"] = dict(workers=threads, worker_threads=threads,
                                                                       qr_first=qr_first)
            configs[f"pool, 1 thread per worker, {route}"] = dict(workers=threads, worker_threads=1,
                                                                    qr_first=qr_first)
    seconds = {name: [] for name in configs}
    names = list(configs)
    for name in names:  # warm-up
        refresh(grads, rank, proj_type, **configs[name])
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for name in order:
            seconds[name].append(refresh(grads, rank, proj_type, **configs[name]))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {seconds[n][-1] * 1e3:.0f} ms" for n in names),
              flush=True)
    median = {name: statistics.median(v) for name, v in seconds.items()}
    shapes = sorted({tuple(g.shape) for g in grads})
    result = {
        **provenance(),
        "machine": machine(f"{threads} threads"),
        "recipe": args.recipe,
        "matrices": len(grads),
        "shapes": {str(list(s)): sum(tuple(g.shape) == s for g in grads) for s in shapes},
        "rank": rank,
        "qr_first_ratio": projection.QR_FIRST_RATIO,
        "refresh_seconds_median": median,
        "refresh_seconds": seconds,
    }
    print(json.dumps(median, indent=2))
    save(result, args.out)


if __name__ == "__main__":
    main()
