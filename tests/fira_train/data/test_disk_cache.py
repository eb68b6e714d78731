"""The disk cache: atomic entries."""

from __future__ import annotations

from pathlib import Path

import pytest

from fira_train.data.disk_cache import atomic_directory


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
