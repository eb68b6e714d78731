"""run_isolated: a function in a fresh process, its result or its exception back here."""

from __future__ import annotations

import os
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


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree from /proc")
def test_the_child_ends_when_its_parent_is_killed() -> None:
    # A parent killed alone (SIGKILL, or a SIGTERM sent to its pid only) must not leave its run
    # training on as an orphan that holds the run folder's lock.
    parent = subprocess.Popen([sys.executable, "-c",
                               "import time\nfrom fira_train.run.isolated import run_isolated\n"
                               "run_isolated(time.sleep, 120)"])
    try:
        child = _wait_for(lambda: _spawned_child(parent.pid), timeout_s=60)
        assert child is not None, "the isolated run did not start"
        parent.kill()
        parent.wait()
        assert _wait_for(lambda: not _alive(child), timeout_s=15), f"child {child} outlived its parent"
    finally:
        parent.kill()


def _spawned_child(pid: int) -> int | None:
    """The pid of ``pid``'s multiprocessing worker (not its resource tracker), if started."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return int(child)
    return None


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
