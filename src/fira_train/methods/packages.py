"""Importing the peers' optional packages without their load-time log noise."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

#: Loggers that report, at import, on optional parts the harness does not use: bitsandbytes
#: (a dependency of apollo-torch and flora-opt) warns that its CPU 4-bit kernels are missing,
#: flora-opt that JAX is not installed.
IMPORT_LOGGERS = ("bitsandbytes", "flora_opt")


@contextlib.contextmanager
def quiet_import_logs(names: tuple[str, ...] = IMPORT_LOGGERS) -> Iterator[None]:
    """Raise the loggers ``names`` to ERROR while the body runs (errors still show)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
