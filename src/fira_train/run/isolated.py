"""Running a function in a fresh process, so that what it measures is its own.

A process's peak resident set covers everything the process did before; memory freed by an
earlier run stays mapped (glibc keeps it) and counts again. ``compare`` and
``memory --measure`` therefore train each method in a fresh, spawned interpreter
(:func:`run_isolated`): its peak is that method's alone. The function's result, or its
exception, comes back through a pipe, so errors read as if the function had run here.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from typing import Any, Callable


def run_isolated(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a spawned process; its return value, or its exception raised
    here. ``fn`` and its arguments must be picklable (a module-level function, dataclasses)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    level = logging.getLogger().getEffectiveLevel()
    process = context.Process(target=_child, args=(send, level, fn, args, kwargs), daemon=False)
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


def _child(send, level: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
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
