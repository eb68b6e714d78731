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


def init_gloo(rank: int, world_size: int, store: str) -> None:
    """Join the group through the rendezvous file ``store`` (the default ``init`` of
    :func:`run_ranks`)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)


def _worker(
    rank: int, world_size: int, workdir: str, store: str, fn: Callable, args: tuple, init: Callable
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share the machine's cores
    out = Path(workdir) / f"result{rank}.pt"
    try:
        try:
            init(rank, world_size, store)
            # Every rank has joined before any runs fn: a rank whose fn failed at once and left
            # made a peer still meshing fail its rendezvous, and that retry ran fn twice
            dist.barrier()
        except BaseException:  # the rendezvous itself failed: the parent may start afresh
            torch.save({"init_error": traceback.format_exc()}, out)
            return
        result = fn(rank, world_size, *args)
        torch.save({"result": result}, out)
    except BaseException:  # report it to the parent, which fails the test with the traceback
        torch.save({"error": traceback.format_exc()}, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    workdir: Path,
    *args: Any,
    timeout: float = 60.0,
    attempts: int = 3,
    init: Callable[[int, int, str], None] = init_gloo,
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own process
    inside one gloo process group; ``fn`` must be a module-level function and return tensors,
    numbers, strings, lists and dicts. Raises ``AssertionError`` with every failed rank's
    traceback if any rank fails, or after ``timeout`` seconds (all attempts together) if any
    rank hangs.

    Gloo's TCP rendezvous on one host now and then loses a connection while the ranks mesh up
    ("connectFullMesh failed ... Connection closed by peer"), before ``fn`` has run a line. Such
    a group is started afresh, with a new rendezvous file, up to ``attempts`` times in all, as
    torch's own distributed tests do for connection failures; an error inside ``fn`` is never
    retried (the ranks pass a barrier after joining, so no rank runs ``fn`` before every rank
    has joined: one that failed at once and left could otherwise break a peer's rendezvous). ``init(rank, world_size, store)`` joins the group (a module-level function, for
    the helper's own tests)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    deadline = _now() + timeout
    for attempt in range(1, attempts + 1):
        outcomes = _run_group(fn, world_size, workdir, args, init, deadline, timeout)
        init_failed = [r for r, o in enumerate(outcomes) if "init_error" in o]
        if not init_failed or attempt == attempts or _now() >= deadline:
            break
    failed = [(r, o.get("error", o.get("init_error"))) for r, o in enumerate(outcomes)
              if "error" in o or "init_error" in o]
    if failed:
        attempts_note = f" (after {attempt} rendezvous attempts)" if init_failed else ""
        report = "\n".join(f"rank {r} failed{attempts_note}:\n{tb}" for r, tb in failed)
        raise AssertionError(report)
    return [o["result"] for o in outcomes]


def _run_group(
    fn: Callable,
    world_size: int,
    workdir: Path,
    args: tuple,
    init: Callable,
    deadline: float,
    timeout: float,
) -> list[dict]:
    """One process group: start the ranks, wait for them until ``deadline``, and return what
    each rank saved (``result``, ``error`` or ``init_error``)."""
    store = workdir / f"store-{uuid.uuid4().hex}"  # a fresh rendezvous file: a stale one hangs gloo
    ctx = _context()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, str(workdir), str(store), fn, args, init),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, deadline - _now()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if hung:
        raise AssertionError(f"ranks {hung} of {world_size} still running after {timeout:.0f} s (hang?)")
    outcomes = []
    for r, p in enumerate(procs):
        path = workdir / f"result{r}.pt"
        if not path.exists():
            raise AssertionError(f"rank {r} exited with code {p.exitcode} and no result")
        outcomes.append(torch.load(path, weights_only=True))
        os.remove(path)
    if store.exists():
        store.unlink()
    return outcomes


def _now() -> float:
    import time

    return time.monotonic()
