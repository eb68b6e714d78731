"""What ``torchrun`` tells each process through its environment, read without importing torch
(so that the command line can use it before anything heavy is loaded), and the mark of an
error that every process of a launch raises alike (:func:`same_on_every_rank`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def is_rank_zero() -> bool:
    """Whether this process prints: the only one, or rank 0 of a ``torchrun`` launch."""
    return int(os.environ.get("RANK", "0")) == 0


def launched_world_size() -> int:
    """The processes ``torchrun`` launched (``WORLD_SIZE``); 1 without ``torchrun``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


#: Set on an error that every process of a launch raises alike (:func:`same_on_every_rank`).
SAME_ON_EVERY_RANK = "fira_same_on_every_rank"


@contextlib.contextmanager
def same_on_every_rank() -> Iterator[None]:
    """Mark an error raised inside as one of the command line and its config alone (a bad
    ``key=value``, an unknown recipe or method, a setting that the method or the number of
    processes refuses): every process of a ``torchrun`` launch is given the same command line
    and raises the same error, so :func:`fira_train.cli.main` prints it on rank 0 alone, not
    once per process. Also a decorator."""
    try:
        yield
    except Exception as err:
        setattr(err, SAME_ON_EVERY_RANK, True)
        raise
