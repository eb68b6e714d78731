"""The disk cache: atomic entries."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fira_train.data.disk_cache as disk_cache
from fira_train.data.disk_cache import ABANDONED_AFTER_S, atomic_directory


def test_atomic_directory_publishes_complete_entries_only(tmp_path: Path) -> None:
    final = tmp_path / "entry"
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as temp:
            (temp / "half.npy").write_bytes(b"partial")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []  # neither the entry nor the temporary folder remains
    with atomic_directory(final) as temp:
        (temp / "data").write_text("first")
    with atomic_directory(final) as temp:  # a second writer of the same key loses the race quietly
        (temp / "data").write_text("second")
    assert (final / "data").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


_WRITE_AND = (
    "import os, signal, sys, time\n"
    "from pathlib import Path\n"
    "from fira_train.data.disk_cache import atomic_directory\n"
    "with atomic_directory(Path(sys.argv[1])) as temp:\n"
    "    (temp / 'train.npy').write_bytes(b'half of the ids')\n"
    "    print('writing', flush=True)\n"
    "    {then}\n"
)


def _age(folder: Path, seconds: float) -> None:
    """Set the times of ``folder`` and of everything in it ``seconds`` back."""
    long_ago = time.time() - seconds
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (long_ago, long_ago))


def _next_write(tokens: Path) -> None:
    with atomic_directory(tokens / "next") as temp:
        (temp / "data").write_text("complete")


def test_the_temporary_folder_of_a_killed_writer_is_removed(tmp_path: Path) -> None:
    """A build killed while writing its entry (``kill -9``, the out-of-memory killer, a scheduler's
    SIGTERM: no ``finally`` runs) left its ``.tmp-*`` folder in the cache for ever: never used,
    never removed, as large as a tokenized corpus. A later write into the same folder removes it:
    its writer, on this machine, is gone."""
    tokens = tmp_path / "tokens"
    code = _WRITE_AND.format(then="os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code, str(tokens / "killed")], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert [p.name for p in tokens.iterdir()][0].startswith(".tmp-killed-")
    _next_write(tokens)
    assert [p.name for p in tokens.iterdir()] == ["next"]


def test_a_stopped_writers_folder_and_a_users_tmp_folder_are_kept_however_old(tmp_path: Path) -> None:
    """A writer stopped for over an hour (SIGSTOP, a laptop asleep) lost its folder to the next
    write, which took it for a killed one by its age; and a ``.tmp-*`` folder of the user's in the
    cache was removed too. A folder is removed only where it names its writer and that one is
    gone."""
    tokens = tmp_path / "tokens"
    writer = subprocess.Popen([sys.executable, "-c", _WRITE_AND.format(then="time.sleep(120)"), str(tokens / "slow")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        (stopped,) = tokens.glob(".tmp-slow-*")
        os.kill(writer.pid, signal.SIGSTOP)
        users = tokens / ".tmp-my-notes"
        users.mkdir()
        (users / "notes.txt").write_text("mine")
        for folder in (stopped, users):
            _age(folder, 2 * ABANDONED_AFTER_S)
        _next_write(tokens)
        assert sorted(p.name for p in tokens.iterdir()) == sorted(["next", stopped.name, users.name])
        assert (stopped / "entry" / "train.npy").read_bytes() == b"half of the ids"
        os.kill(writer.pid, signal.SIGCONT)  # woken, it finishes its entry
        os.kill(writer.pid, signal.SIGTERM)
    finally:
        writer.kill()
        writer.wait(timeout=60)


def test_another_machines_writer_is_taken_for_gone_after_an_hour_without_a_write(tmp_path: Path) -> None:
    """A cache shared by machines: another one's process cannot be asked, so its folder goes once
    nothing in it was written for :data:`ABANDONED_AFTER_S`."""
    tokens = tmp_path / "tokens"
    for name in ("old", "recent"):
        folder = tokens / f".tmp-{name}-123-abcdef01"
        (folder / "entry").mkdir(parents=True)
        (folder / disk_cache.WRITER_FILE).write_text(json.dumps({"host": "another-machine", "pid": 123}))
        (folder / "entry" / "train.npy").write_bytes(b"ids")
    _age(tokens / ".tmp-old-123-abcdef01", ABANDONED_AFTER_S + 60)
    not_a_record = tokens / ".tmp-not-a-record"  # a process id that would signal a group: never asked
    not_a_record.mkdir()
    (not_a_record / disk_cache.WRITER_FILE).write_text(json.dumps({"host": disk_cache.this_host(), "pid": 0}))
    _age(not_a_record, 2 * ABANDONED_AFTER_S)
    _next_write(tokens)
    assert sorted(p.name for p in tokens.iterdir()) == sorted(["next", ".tmp-recent-123-abcdef01", not_a_record.name])


def test_a_live_writers_folder_is_not_removed_by_a_machine_whose_clock_is_ahead(tmp_path: Path, monkeypatch) -> None:
    """Two machines sharing the cache (a network file system, whose server stamps the files'
    times): a folder's age was its mtime against this machine's clock, so a machine whose clock
    ran an hour ahead took another's live writer for a killed one and removed its folder under
    it (its build then failed with 'No such file or directory'). The age is measured on the file
    system's own clock: the time it stamps on the folder this write has just made."""
    tokens = tmp_path / "tokens"
    live = tokens / ".tmp-other-123-abcdef01"
    old = tokens / ".tmp-killed-456-abcdef02"
    for folder in (live, old):
        folder.mkdir(parents=True)
        (folder / disk_cache.WRITER_FILE).write_text(json.dumps({"host": "another-machine", "pid": 123}))
    (live / "train.npy").write_bytes(b"ids being written")
    _age(old, ABANDONED_AFTER_S + 60)
    real_time = time.time
    ahead = type("Clock", (), {"time": staticmethod(lambda: real_time() + 2 * 3600)})
    monkeypatch.setattr(disk_cache, "time", ahead, raising=False)  # this machine's clock (the module's)
    with atomic_directory(tokens / "next") as temp:
        (temp / "data").write_text("complete")
    assert sorted(p.name for p in tokens.iterdir()) == sorted(["next", live.name])


def test_a_full_disk_at_the_writer_record_names_the_file(tmp_path: Path, monkeypatch) -> None:
    """A full cache disk fails the writer's record first, at its close, with an error that names
    no file: the one-line error then said the run's --out was full, and to move it."""
    real = Path.write_text

    def full(path, *args, **kwargs):
        if path.name == disk_cache.WRITER_FILE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as caught:
        with atomic_directory(tmp_path / "tokens" / "key"):
            pass
    assert caught.value.errno == errno.ENOSPC
    assert caught.value.filename is not None and caught.value.filename.startswith(str(tmp_path / "tokens"))
    assert list((tmp_path / "tokens").iterdir()) == []  # its temporary folder removed
