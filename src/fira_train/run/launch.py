"""What ``torchrun`` tells each process through its environment, read without importing torch
(so that the command line can use it before anything heavy is loaded), and the marks of an
error that every process of a launch raises alike (:func:`same_on_every_rank`) and of one raised
before a new run wrote anything (:func:`before_the_run`)."""

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


def refuse_torchrun(what: str) -> None:
    """ValueError under a ``torchrun`` launch of several processes, for a command whose processes
    would each do all of its work into the same ``--out`` (``what``: how it runs, e.g. "sweep runs
    each training in its own process (--jobs)"). Every process raises it alike: rank 0 prints it."""
    if launched_world_size() > 1:
        error = ValueError(f"{what}: launch it in one process, not under torchrun ({launched_world_size()} processes "
                           "were launched); torchrun launches pretrain or compare with --parallel ddp|fsdp2")
        setattr(error, SAME_ON_EVERY_RANK, True)
        raise error


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


#: Set on an error raised before a new run (not a resumed one) wrote anything in its output
#: folder, as its data was built (:func:`before_the_run`): what the folder holds then is an earlier
#: run's, or nothing, and ``--resume`` would continue that one, not start this one.
BEFORE_THE_RUN = "fira_before_the_run"


@contextlib.contextmanager
def before_the_run(new: bool) -> Iterator[None]:
    """Mark an error (or Ctrl-C) raised inside as :data:`BEFORE_THE_RUN` where the run is ``new``
    (started without ``--resume``), for the hint of how to go on (:mod:`fira_train.user_errors`)."""
    try:
        yield
    except BaseException as err:
        if new:
            setattr(err, BEFORE_THE_RUN, True)
        raise
