"""The run folder's lock (fira_train.run.run_lock): taken of the lock file that is there."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from fira_train.run import run_lock
from fira_train.run.run_lock import LOCK_FILE, RunLock


@pytest.mark.parametrize("when", ["after the open", "before the open"])
def test_a_lock_file_removed_while_the_lock_is_taken_is_taken_again(when: str, tmp_path: Path, monkeypatch) -> None:
    """A start that stopped before writing anything removes its lock file and the folder it made.
    Another run that had opened that file (or made the folder) just before took a lock of a file
    that was gone, in a folder that was gone: its first write failed, and a third run could take
    the folder's new lock file beside it."""
    out = tmp_path / "new"
    real = run_lock.open_regular
    raced: list[int] = []

    def racing(path, flags, mode):
        if raced:
            return real(path, flags, mode)
        raced.append(1)
        if when == "before the open":  # the folder goes between this run's mkdir and its open
            out.rmdir()
            return real(path, flags, mode)
        fd = real(path, flags, mode)
        os.unlink(path)  # the other run's cleanup, while it held the lock
        out.rmdir()
        return fd

    monkeypatch.setattr(run_lock, "open_regular", racing)
    lock = RunLock(out)
    lock.acquire()
    try:
        assert lock.held and os.path.samestat(os.stat(out / LOCK_FILE), os.fstat(lock._fd))
        with pytest.raises(run_lock.RunDirectoryBusy):  # and it is the folder's lock
            RunLock(out).acquire()
    finally:
        lock.release()


def _lock_out_worker(rank: int, world: int, out: str) -> list:
    from fira_train.run.launch import SAME_ON_EVERY_RANK
    from fira_train.run.parallel import current_env
    from fira_train.user_errors import describe

    try:
        with run_lock.locked_run_directory(out, current_env()):
            return ["locked"]
    except OSError as err:
        return [type(err).__name__, err.errno, err.filename, describe(err), getattr(err, SAME_ON_EVERY_RANK, False)]


@pytest.mark.timeout(120)
def test_under_torchrun_every_rank_reports_an_out_it_cannot_make_as_rank_0_does(tmp_path: Path) -> None:
    """`torchrun ... --out FILE/run`: rank 0 said "FILE/run: Not a directory (a file is where a
    folder is needed); ...", the other rank "[Errno 20] Not a directory: 'FILE/run'" (the error
    it rebuilt from rank 0's text had lost its errno, so it was not described)."""
    from tests.multiprocess import run_ranks

    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "run"
    results = run_ranks(_lock_out_worker, 2, tmp_path / "w", str(out), timeout=100)
    assert results[0][:3] == ["NotADirectoryError", errno.ENOTDIR, str(out)], results
    assert results[1] == results[0]
    assert "a file is where a folder is needed" in results[0][3]
    assert results[1][4] is True  # rank 0's refusal, printed by rank 0 alone (fira_train.cli)


def _busy_worker(rank: int, world: int, out: str) -> list:
    from fira_train.run.launch import SAME_ON_EVERY_RANK
    from fira_train.run.parallel import current_env

    try:
        with run_lock.locked_run_directory(out, current_env()):
            return ["locked"]
    except run_lock.RunDirectoryBusy as err:
        return [str(err), getattr(err, SAME_ON_EVERY_RANK, False)]


@pytest.mark.timeout(120)
def test_under_torchrun_a_held_out_is_refused_by_every_rank_and_said_once(tmp_path: Path) -> None:
    """A second launch into a run's --out: every process printed "run directory ... is in use",
    one line per process, for the one decision rank 0 made."""
    from tests.multiprocess import run_ranks

    lock = RunLock(tmp_path / "run")
    lock.acquire()
    try:
        results = run_ranks(_busy_worker, 2, tmp_path / "w", str(tmp_path / "run"), timeout=100)
    finally:
        lock.release()
    assert results[0][0] == results[1][0] and "is in use by another fira-train run" in results[0][0]
    assert [marked for _, marked in results] == [True, True]
