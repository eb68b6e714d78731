"""File helpers shared by the checkpoints and the data cache: a file's SHA-256, a directory's fsync."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def file_digest(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes (hex), read in chunks so large files need no extra memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it) to disk, where the platform allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
