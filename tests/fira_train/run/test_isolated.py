"""run_isolated: a function in a fresh process, its result or its exception back here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fira_train.run.isolated import run_isolated


def test_the_function_runs_in_another_process_and_returns_its_result() -> None:
    assert run_isolated(os.getpid) != os.getpid()
    assert run_isolated(divmod, 17, 5) == (3, 2)


def test_its_exception_is_raised_here_with_its_type() -> None:
    with pytest.raises(FileExistsError, match="busy"):
        run_isolated(_refuse, "busy")


def _refuse(message: str) -> None:
    raise FileExistsError(message)


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc")
def test_the_child_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    # A parent killed alone (SIGKILL, or a SIGTERM sent to its pid only) must not leave its run
    # training on as an orphan that holds the run folder's lock.
    marker = tmp_path / "child.pid"
    body = f"import os, pathlib, time; pathlib.Path({str(marker)!r}).write_text(str(os.getpid())); time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c",
                               "from fira_train.run.isolated import run_isolated\n"
                               f"run_isolated(exec, {body!r})"])
    child = None
    try:
        # the marker is written by the function, which starts after the parent-watch thread
        assert _wait_for(lambda: marker.is_file() and marker.read_text(), timeout_s=120), "the run did not start"
        child = int(marker.read_text())
        parent.kill()
        parent.wait()
        assert _wait_for(lambda: not _alive(child), timeout_s=30), f"child {child} outlived its parent"
    finally:
        parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has ended; only its exit status waits to be collected


def _wait_for(condition, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.2)
    return None


def test_a_child_that_dies_says_how() -> None:
    with pytest.raises(RuntimeError, match="killed by SIGABRT"):
        run_isolated(os.abort)
    with pytest.raises(RuntimeError, match="exit code 3"):
        run_isolated(os._exit, 3)
