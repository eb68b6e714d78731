"""The disk cache: atomic entries."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def test_the_temporary_folder_of_a_killed_writer_is_removed_once_abandoned(tmp_path: Path) -> None:
    """A build killed while writing its entry (``kill -9``, the out-of-memory killer, a scheduler's
    SIGTERM: no ``finally`` runs) left its ``.tmp-*`` folder in the cache for ever: never used,
    never removed, as large as a tokenized corpus. A later write into the same folder removes
    those untouched for :data:`ABANDONED_AFTER_S`; a recent one may be a live writer's and stays."""
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from fira_train.data.disk_cache import atomic_directory\n"
        "with atomic_directory(Path(sys.argv[1])) as temp:\n"
        "    (temp / 'train.npy').write_bytes(b'half of the ids')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    tokens = tmp_path / "tokens"
    for key in ("old", "recent"):
        done = subprocess.run([sys.executable, "-c", code, str(tokens / key)], capture_output=True, timeout=60)
        assert done.returncode == -signal.SIGKILL, done.stderr
    (old,) = tokens.glob(".tmp-old-*")
    (recent,) = tokens.glob(".tmp-recent-*")
    long_ago = time.time() - ABANDONED_AFTER_S - 60
    for path in (old / "train.npy", old):
        os.utime(path, (long_ago, long_ago))
    with atomic_directory(tokens / "next") as temp:
        (temp / "data").write_text("complete")
    assert sorted(p.name for p in tokens.iterdir()) == sorted(["next", recent.name])


def test_a_live_writers_folder_is_not_removed_by_a_machine_whose_clock_is_ahead(tmp_path: Path, monkeypatch) -> None:
    """Two machines sharing the cache (a network file system, whose server stamps the files'
    times): a folder's age was its mtime against this machine's clock, so a machine whose clock
    ran an hour ahead took another's live writer for a killed one and removed its folder under
    it (its build then failed with 'No such file or directory'). The age is measured on the file
    system's own clock: the time it stamps on the folder this write has just made."""
    import fira_train.data.disk_cache as disk_cache

    tokens = tmp_path / "tokens"
    live = tokens / ".tmp-other-123-abcdef01"
    live.mkdir(parents=True)
    (live / "train.npy").write_bytes(b"ids being written")
    old = tokens / ".tmp-killed-456-abcdef02"
    old.mkdir()
    long_ago = time.time() - ABANDONED_AFTER_S - 60
    os.utime(old, (long_ago, long_ago))
    real_time = time.time
    ahead = type("Clock", (), {"time": staticmethod(lambda: real_time() + 2 * 3600)})
    monkeypatch.setattr(disk_cache, "time", ahead, raising=False)  # this machine's clock (the module's)
    with atomic_directory(tokens / "next") as temp:
        (temp / "data").write_text("complete")
    assert sorted(p.name for p in tokens.iterdir()) == sorted(["next", live.name])
