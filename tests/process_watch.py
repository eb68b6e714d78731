"""Watching other processes from a test: has a pid ended, wait for a condition (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

#: Skip marker for the tests that read process states from /proc.
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc")


def ended(pid: int) -> bool:
    """True once ``pid`` has exited: gone, or a zombie whose exit status waits to be collected."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def wait_for(condition: Callable[[], Any], timeout_s: float) -> Any:
    """``condition()``'s first truthy value within ``timeout_s`` seconds, else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.1)
    return None


def pid_written(marker: Path, timeout_s: float = 60) -> int:
    """The pid a started process wrote to ``marker`` (fails the test if none came)."""
    text = wait_for(lambda: marker.is_file() and marker.read_text(), timeout_s)
    if not text:
        pytest.fail(f"no process wrote its pid to {marker} within {timeout_s} s")
    return int(text)


@contextlib.contextmanager
def parent_and_pid(argv: list[str], marker: Path, timeout_s: float = 60, **popen: Any) -> Iterator[tuple[Any, int]]:
    """Start ``argv`` (a parent that starts a process writing its pid to ``marker``); yield the
    parent's ``Popen`` and that pid once written; afterwards kill whichever of the two still lives."""
    parent = subprocess.Popen(argv, **popen)
    pid = None
    try:
        pid = pid_written(marker, timeout_s)
        yield parent, pid
    finally:
        parent.kill()
        parent.wait()
        if pid is not None and not ended(pid):
            os.kill(pid, signal.SIGKILL)
