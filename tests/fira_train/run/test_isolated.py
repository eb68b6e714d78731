"""run_isolated: a function in a fresh process, its result or its exception back here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fira_train.run.isolated import run_isolated
from tests.process_watch import ended, needs_proc, pid_written, wait_for


def test_the_function_runs_in_another_process_and_returns_its_result() -> None:
    assert run_isolated(os.getpid) != os.getpid()
    assert run_isolated(divmod, 17, 5) == (3, 2)


def test_its_exception_is_raised_here_with_its_type() -> None:
    with pytest.raises(FileExistsError, match="busy"):
        run_isolated(_refuse, "busy")


def _refuse(message: str) -> None:
    raise FileExistsError(message)


@needs_proc
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
        child = pid_written(marker, timeout_s=120)
        parent.kill()
        parent.wait()
        assert wait_for(lambda: ended(child), timeout_s=30), f"child {child} outlived its parent"
    finally:
        parent.kill()
        if child is not None and not ended(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_that_dies_says_how() -> None:
    with pytest.raises(RuntimeError, match="killed by SIGABRT"):
        run_isolated(os.abort)
    with pytest.raises(RuntimeError, match="exit code 3"):
        run_isolated(os._exit, 3)
