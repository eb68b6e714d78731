"""Running a function in a fresh process, so that what it measures is its own.

A process's peak resident set covers everything the process did before; memory freed by an
earlier run stays mapped (glibc keeps it) and counts again. ``compare`` and
``memory --measure`` therefore train each method in a fresh, spawned interpreter
(:func:`run_isolated`): its peak is that method's alone. The function's result, or its
exception, comes back through a pipe, so errors read as if the function had run here. A child
whose parent is gone (killed, or stopped by a signal that did not reach the child) ends itself
within a second: it would otherwise keep training with nobody to receive its result, and keep
its run folder locked.

:func:`run_isolated_many` runs several such calls, ``jobs`` at a time (the analyses' and the
sweep's ``--jobs``), and :func:`with_threads` gives each of them its share of the CPU cores.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from typing import Any, Callable

from fira_train.config.run_config import RunConfig

log = logging.getLogger(__name__)


def run_isolated(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a spawned process; its return value, or its exception raised
    here. ``fn`` and its arguments must be picklable (a module-level function, dataclasses)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    level = logging.getLogger().getEffectiveLevel()
    process = context.Process(target=_child, args=(send, level, os.getpid(), fn, args, kwargs), daemon=False)
    process.start()
    send.close()
    try:
        status, payload = receive.recv()
    except EOFError:  # the child died without a word (killed, out of memory)
        process.join()
        raise RuntimeError(f"the isolated run of {getattr(fn, '__name__', fn)} ended with exit code "
                           f"{process.exitcode} and no result (killed? out of memory?)") from None
    finally:
        receive.close()
    process.join()
    if status == "error":
        raise payload
    return payload


def _child(send, level: int, parent: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    threading.Thread(target=_end_when_orphaned, args=(parent,), daemon=True,
                     name="fira-train-parent-watch").start()
    try:
        result = ("ok", fn(*args, **kwargs))
    except BaseException as err:  # noqa: BLE001 - handed to the parent, which raises it
        result = ("error", err)
    try:
        send.send(result)
    except Exception:  # an unpicklable result or exception: its text
        status, payload = result
        send.send(("error", RuntimeError(f"{type(payload).__name__}: {payload}")))
    finally:
        send.close()


def _end_when_orphaned(parent: int, poll_s: float = 0.5) -> None:
    """Send this process SIGTERM once its parent ``parent`` has exited (this process is then
    re-parented, so ``os.getppid()`` changes). SIGTERM's default action ends it, as a ``kill`` would
    have if it had reached the whole process group; a run loses at most the work since its last
    checkpoint."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    log.error("the parent process %d is gone: ending this run (pid %d)", parent, os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)


def run_isolated_many(calls: Sequence[tuple[Callable[..., Any], tuple]], jobs: int,
                      on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
    """``[fn(*args) for fn, args in calls]``, each in a spawned process (:func:`run_isolated`), up to
    ``jobs`` at a time, started in order. ``on_result(index, result)`` runs here as each call
    finishes. If a call fails, the others still run to their end (no work is lost) and then the
    first error is raised."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got jobs={jobs!r}")
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_isolated, fn, *args): index for index, (fn, args) in enumerate(calls)}
        for future in as_completed(futures):
            index = futures[future]
            try:
                results[index] = future.result()
            except Exception as err:  # noqa: BLE001 - raised after the others finish
                log.error("run %d of %d failed: %s", index + 1, len(calls), err)
                errors.append(err)
                continue
            if on_result is not None:
                on_result(index, results[index])
    if errors:
        raise errors[0]
    return results


def with_threads(config: RunConfig, jobs: int) -> RunConfig:
    """``config`` for one of ``jobs`` runs sharing this machine: ``cpu_count // jobs`` torch threads
    unless it names its own, and no progress bar (parallel bars would overwrite each other). One
    job: ``config`` unchanged."""
    if jobs <= 1:
        return config
    train_config = config.train
    if not train_config.num_threads:
        train_config = replace(train_config, num_threads=max(1, (os.cpu_count() or 1) // jobs))
    return replace(config, train=replace(train_config, progress=False))
