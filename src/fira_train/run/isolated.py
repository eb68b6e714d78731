"""Running a function in a fresh process, so that what it measures is its own.

A process's peak resident set covers everything the process did before; memory freed by an
earlier run stays mapped (glibc keeps it) and counts again. ``compare`` and
``memory --measure`` therefore train each method in a fresh, spawned interpreter
(:func:`run_isolated`): its peak is that method's alone. The function's result, or its
exception, comes back through a pipe, so errors read as if the function had run here. A child
whose parent has died (killed alone, by a signal that did not reach the child's process group, or
by the out-of-memory killer) ends itself: it would otherwise keep training with nobody to receive
its result, and keep its run folder locked. It learns of the death from a second pipe whose only
writer is the parent, which the kernel closes when the parent exits, however it exits.

:func:`run_isolated_many` runs several such calls, ``jobs`` at a time (the analyses' and the
sweep's ``--jobs``), and :func:`with_threads` gives each of them its share of the CPU cores.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from typing import Any, Callable

from fira_train.config.run_config import RunConfig
from fira_train.run.process_logging import configure_logging, one_line_warnings

log = logging.getLogger(__name__)


#: The children of :func:`run_isolated` still running, stopped by :func:`run_isolated_many` when it
#: is interrupted (their threads wait on them and would otherwise keep going, and start the rest).
_LIVE: set[Any] = set()
_LIVE_LOCK = threading.Lock()
#: Set while an interrupted run_isolated_many stops its children: one started meanwhile stops too.
_STOPPING = threading.Event()
#: What :func:`run_isolated` tells its child when it is interrupted (Ctrl-C) and stops waiting.
STOP = "stop"


def run_isolated(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a spawned process; its return value, or its exception raised
    here. ``fn`` and its arguments must be picklable (a module-level function, dataclasses)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    # the child reads end-of-file on this one when this process is gone, and STOP before it when
    # this process was interrupted (Ctrl-C) and stops waiting for the run
    parent_gone, parent_alive = context.Pipe(duplex=False)
    level = logging.getLogger().getEffectiveLevel()
    process = context.Process(target=_child, args=(send, parent_gone, level, fn, args, kwargs), daemon=False)
    with _interrupts_held():  # the child starts with SIGINT held, until _child can take it
        process.start()
    with _LIVE_LOCK:
        _LIVE.add(process)
        if _STOPPING.is_set():
            process.terminate()
    send.close()
    parent_gone.close()
    try:
        try:
            status, payload = receive.recv()
        except EOFError:  # the child died without a word
            process.join()
            # the function's name ("train", "_train_one") tells a user nothing: the progress lines
            # above name the run, and the command line adds how to continue it
            raise IsolatedRunDied(f"the run's process (pid {process.pid}) ended without a result: "
                                  f"{_how_it_ended(process.exitcode)}") from None
        finally:
            receive.close()
        process.join()
    except BaseException:  # Ctrl-C here: the child is told so before it stops (not "parent gone")
        with contextlib.suppress(OSError):  # a child that has ended already
            parent_alive.send(STOP)
        raise
    finally:  # after the child's end, or on an exception here (Ctrl-C): the child stops too
        parent_alive.close()
        with _LIVE_LOCK:
            _LIVE.discard(process)
    if status == "error":
        raise payload
    return payload


@contextlib.contextmanager
def _interrupts_held():
    """SIGINT blocked in this thread (a process started here inherits the mask), and released at
    the end; a Ctrl-C meanwhile reaches this process's other threads (the main thread's handler).

    Ctrl-C reaches the whole process group, so also a child still in multiprocessing's start-up
    code (a second or more of imports), where nothing of ours could catch it: it printed a
    KeyboardInterrupt traceback. Held until :func:`_child` releases it, where an interrupt is
    handed back as any exception of the run is."""
    held = hasattr(signal, "pthread_sigmask")
    if held:
        # started first: starting multiprocessing's resource tracker (on the first process
        # started) unblocks SIGINT in the starting thread, which would release the hold early
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if held:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class IsolatedRunDied(RuntimeError):
    """The child process of :func:`run_isolated` ended without an answer (killed, or its
    interpreter failed): the message says how, for the user (no traceback of ours helps)."""


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}" + (" (out of memory?)" if -exitcode == signal.SIGKILL else "")
    # the interpreter failed before the function could answer (e.g. a parent and a child running
    # different versions of this code after an upgrade mid-run): its traceback is on stderr
    return f"exit code {exitcode}; its error, if any, is printed above"


def _child(send, parent_gone, level: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    configure_logging(level)
    warnings.formatwarning = one_line_warnings("fira-train")  # this process ends with the run
    # tqdm locks its bars with a multiprocessing lock, a named semaphore that only a clean exit
    # removes: a run ended by SIGTERM (Ctrl-C stops it so, see _end_when_orphaned) left it to the
    # resource tracker, which printed "leaked semaphore objects" on the terminal. This process's
    # bars are shared with no other process, so a thread lock is all they need.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    threading.Thread(target=_end_when_orphaned, args=(parent_gone,), daemon=True,
                     name="fira-train-parent-watch").start()
    try:
        if hasattr(signal, "pthread_sigmask"):  # held since the start (_interrupts_held): one that came is raised here
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        result = ("ok", fn(*args, **kwargs))
    except BaseException as err:  # noqa: BLE001 - handed to the parent, which raises it
        result = ("error", err)
    try:
        send.send(result)
    except BrokenPipeError:
        # the parent stopped waiting (Ctrl-C, which reaches this process too and which the parent
        # reports itself) or is gone (_wait_for_parent says so): nobody to tell, no traceback
        pass
    except Exception:  # an unpicklable result or exception: its text
        status, payload = result
        with contextlib.suppress(BrokenPipeError):
            send.send(("error", RuntimeError(f"{type(payload).__name__}: {payload}")))
    finally:
        send.close()


def _end_when_orphaned(parent_gone, grace_s: float = 10.0) -> None:
    """End this process once the parent has closed its end of ``parent_gone`` (it has exited, or
    it stopped waiting for this run): SIGTERM first, whose default action ends it as a ``kill`` of
    the process group would have; if this process survives it (SIGTERM ignored, or a handler that
    does not exit), ``os._exit`` after ``grace_s`` seconds. A run loses at most the work since its
    last checkpoint."""
    _wait_for_parent(parent_gone)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(128 + signal.SIGTERM)


def _wait_for_parent(parent_gone) -> None:
    """Return once the parent has closed its end of ``parent_gone``; say so where it went without
    a word (killed, or it died): a parent that was interrupted (Ctrl-C) sent :data:`STOP` first,
    and says itself that the command was interrupted, so an error line here read as a crash."""
    try:
        word = parent_gone.recv()
    except (EOFError, OSError):
        word = None
    if word != STOP:
        log.error("the parent process is gone: ending this run (pid %d)", os.getpid())


def run_isolated_many(calls: Sequence[tuple[Callable[..., Any], tuple]], jobs: int,
                      on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
    """``[fn(*args) for fn, args in calls]``, each in a spawned process (:func:`run_isolated`), up to
    ``jobs`` at a time, started in order. ``on_result(index, result)`` runs here as each call
    finishes. If a call fails, the others still run to their end (no work is lost) and then the
    first error is raised. If this is interrupted (Ctrl-C), no queued call starts and the running
    ones are stopped: each loses at most the work since its last checkpoint."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got jobs={jobs!r}")
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
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
    except BaseException:  # Ctrl-C: no queued call starts, the running ones stop (SIGTERM)
        pool.shutdown(wait=False, cancel_futures=True)
        with _LIVE_LOCK:
            _STOPPING.set()
            for process in list(_LIVE):
                process.terminate()
        raise
    finally:
        try:
            pool.shutdown(wait=True)
        finally:
            _STOPPING.clear()
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
