"""What ``torchrun`` tells each process through its environment, read without importing torch
(so that the command line can use it before anything heavy is loaded)."""

from __future__ import annotations

import os


def is_rank_zero() -> bool:
    """Whether this process prints: the only one, or rank 0 of a ``torchrun`` launch."""
    return int(os.environ.get("RANK", "0")) == 0


def launched_world_size() -> int:
    """The processes ``torchrun`` launched (``WORLD_SIZE``); 1 without ``torchrun``."""
    return int(os.environ.get("WORLD_SIZE", "1"))
