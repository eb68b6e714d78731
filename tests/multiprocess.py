"""Run a function on several gloo processes on CPU, under a timeout (test helper).

Processes come from a ``forkserver`` that imports torch (and its distributed modules) once, so
each test pays milliseconds, not seconds, per process, and children never inherit the OpenMP
state of the pytest process (GNU OpenMP is not fork-safe). A process that hangs fails the test
after ``timeout`` seconds instead of blocking the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

_PRELOAD = [
    "torch",
    "torch._dynamo",  # DTensor and torch.optim import it lazily: seconds per process otherwise
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs: it is then preloaded
    return ctx


def _worker(rank: int, world_size: int, workdir: str, store: str, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share the machine's cores
    out = Path(workdir) / f"result{rank}.pt"
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size
        )
        result = fn(rank, world_size, *args)
        torch.save({"result": result}, out)
    except BaseException:  # report it to the parent, which fails the test with the traceback
        torch.save({"error": traceback.format_exc()}, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, workdir: Path, *args: Any, timeout: float = 60.0
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own process
    inside one gloo process group; ``fn`` must be a module-level function and return tensors,
    numbers, strings, lists and dicts. Raises ``AssertionError`` with the worker's traceback if
    any rank fails, or after ``timeout`` seconds if any rank hangs."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / f"store-{uuid.uuid4().hex}"  # a fresh rendezvous file: a stale one hangs gloo
    ctx = _context()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, str(workdir), str(store), fn, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = _now() + timeout
    for p in procs:
        p.join(max(0.0, deadline - _now()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if hung:
        raise AssertionError(f"ranks {hung} of {world_size} still running after {timeout:.0f} s (hang?)")
    results = []
    for r, p in enumerate(procs):
        path = workdir / f"result{r}.pt"
        if not path.exists():
            raise AssertionError(f"rank {r} exited with code {p.exitcode} and no result")
        saved = torch.load(path, weights_only=True)
        if "error" in saved:
            raise AssertionError(f"rank {r} failed:\n{saved['error']}")
        results.append(saved["result"])
        os.remove(path)
    if store.exists():
        store.unlink()
    return results


def _now() -> float:
    import time

    return time.monotonic()
