"""run_isolated: a function in a fresh process, its result or its exception back here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from fira_train.run.isolated import run_isolated
from tests.process_watch import ended, needs_proc, parent_and_pid, wait_for


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
    argv = [sys.executable, "-c", f"from fira_train.run.isolated import run_isolated\nrun_isolated(exec, {body!r})"]
    # the marker is written by the function, which starts after the parent-watch thread
    with parent_and_pid(argv, marker, timeout_s=120) as (parent, child):
        parent.kill()
        parent.wait()
        assert wait_for(lambda: ended(child), timeout_s=30), f"child {child} outlived its parent"


def test_a_run_ended_by_a_signal_leaves_no_semaphore_behind() -> None:
    """Ctrl-C during ``compare`` ends its child by SIGTERM (the parent stops waiting for it). The
    child's progress bar held tqdm's multiprocessing lock, a semaphore that only the child's own
    clean exit removes: the parent printed multiprocessing's "leaked semaphore objects" warning
    at its exit, after the "interrupted" line."""
    import subprocess

    body = ("import os, signal, io; from tqdm.auto import tqdm; tqdm(total=3, file=io.StringIO()).update(1); "
            "os.kill(os.getpid(), signal.SIGTERM)")
    script = ("from fira_train.run.isolated import IsolatedRunDied, run_isolated\n"
              f"try:\n    run_isolated(exec, {body!r})\nexcept IsolatedRunDied as err:\n    print(err)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "killed by SIGTERM" in done.stdout, (done.stdout, done.stderr)
    assert "leaked semaphore" not in done.stderr, done.stderr


def test_a_child_that_dies_says_how() -> None:
    with pytest.raises(RuntimeError, match="killed by SIGABRT"):
        run_isolated(os.abort)
    with pytest.raises(RuntimeError, match="exit code 3"):
        run_isolated(os._exit, 3)


def _mark_after(path: str, seconds: float) -> str:
    import time

    Path(path).write_text("started")
    time.sleep(seconds)
    return path


def test_an_interrupted_batch_starts_no_more_runs_and_stops_the_running_ones(tmp_path: Path) -> None:
    """Ctrl-C during analyze --jobs N: the queued runs started anyway and the running ones trained on."""
    import time

    from fira_train.run.isolated import run_isolated_many

    calls = [(_mark_after, (str(tmp_path / "quick"), 0.0)), (_mark_after, (str(tmp_path / "long"), 60.0)),
             (_mark_after, (str(tmp_path / "queued"), 0.0))]

    def interrupt(index, result):
        raise KeyboardInterrupt

    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_isolated_many(calls, jobs=1, on_result=interrupt)
    assert time.perf_counter() - started < 40  # the 60 s run was stopped
    assert not (tmp_path / "queued").exists()


def _shown_warning() -> str:
    import warnings

    return warnings.formatwarning("rank=1000 is >= min(m, n)", UserWarning, "/x/optimizers.py", 150)


def test_a_warning_in_the_run_is_one_line() -> None:
    """compare's and sweep's runs: Python's two lines (fira-train's file, its source line) before."""
    assert run_isolated(_shown_warning) == "fira-train: warning: rank=1000 is >= min(m, n) (UserWarning)\n"


def test_a_child_told_to_stop_says_nothing_and_one_orphaned_says_why(caplog) -> None:
    """Ctrl-C during compare: the child logged "the parent process is gone", which read as a crash
    beside the command's own "interrupted" line. An interrupted parent says STOP before it closes
    its end; a parent that goes without a word (killed) is still reported."""
    import multiprocessing

    from fira_train.run import isolated

    for word, said in ((isolated.STOP, False), (None, True)):
        gone, alive = multiprocessing.Pipe(duplex=False)
        if word is not None:
            alive.send(word)
        alive.close()
        caplog.clear()
        with caplog.at_level("ERROR"):
            isolated._wait_for_parent(gone)
        assert ("the parent process is gone" in caplog.text) is said, word
        gone.close()


@needs_proc
def test_an_interrupted_parent_tells_its_child_to_stop(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the parent): the child ends, and without the "parent process is gone" line."""
    import signal
    import subprocess

    marker = tmp_path / "child.pid"
    # the child ignores SIGINT here, so that it ends by the parent's word alone, as a run that has
    # caught its own KeyboardInterrupt and is saving would
    body = (f"import os, pathlib, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            f"pathlib.Path({str(marker)!r}).write_text(str(os.getpid())); time.sleep(120)")
    argv = [sys.executable, "-c", f"from fira_train.run.isolated import run_isolated\nrun_isolated(exec, {body!r})"]
    with parent_and_pid(argv, marker, timeout_s=120, stderr=subprocess.PIPE, text=True) as (parent, child):
        parent.send_signal(signal.SIGINT)
        _, err = parent.communicate(timeout=60)
        assert wait_for(lambda: ended(child), timeout_s=30), f"child {child} outlived its parent"
    assert "KeyboardInterrupt" in err and "the parent process is gone" not in err, err


@needs_proc
def test_a_result_the_interrupted_parent_no_longer_waits_for_is_dropped_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C during compare reaches the run's process too: when it handed its KeyboardInterrupt
    back after the parent had stopped waiting (and closed the pipe), it printed a BrokenPipeError
    traceback after the command's "interrupted" line."""
    import signal
    import subprocess

    marker, stopped = tmp_path / "child.pid", tmp_path / "parent.stopped"
    # the child outlives the parent's SIGTERM (a run saving its checkpoint) and ends with its own
    # KeyboardInterrupt once the parent has stopped waiting for it
    body = (f"import os, pathlib, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            f"signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"pathlib.Path({str(marker)!r}).write_text(str(os.getpid()))\n"
            f"while not pathlib.Path({str(stopped)!r}).exists(): time.sleep(0.05)\n"
            "raise KeyboardInterrupt")
    script = ("import pathlib\nfrom fira_train.run.isolated import run_isolated\n"
              f"try:\n    run_isolated(exec, {body!r})\n"
              f"except KeyboardInterrupt:\n    pathlib.Path({str(stopped)!r}).write_text('')\n")
    with parent_and_pid([sys.executable, "-c", script], marker, timeout_s=120, stderr=subprocess.PIPE,
                        text=True) as (parent, child):
        parent.send_signal(signal.SIGINT)
        _, err = parent.communicate(timeout=60)  # the parent's exit waits for the child's
        assert ended(child)
    assert stopped.exists(), err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_ctrl_c_while_the_child_starts_up_prints_no_traceback(monkeypatch, capfd) -> None:
    """Ctrl-C reaches the whole process group: a child still starting (importing torch, a second
    or more of every run under sweep --jobs) died in multiprocessing's start-up code, before any
    handler of ours ran, and printed a KeyboardInterrupt traceback for each such run after the
    command's one "interrupted" line. The child now hands the interrupt back as a run does."""
    import signal
    import time
    from multiprocessing.context import SpawnProcess

    start = SpawnProcess.start

    def start_then_interrupt(self) -> None:
        start(self)
        time.sleep(0.3)  # into its start-up imports
        os.kill(self.pid, signal.SIGINT)  # as Ctrl-C would, while the child is still starting

    monkeypatch.setattr(SpawnProcess, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_isolated(os.getpid)
    assert "Traceback" not in capfd.readouterr().err
