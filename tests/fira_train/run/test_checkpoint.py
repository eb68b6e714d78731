"""Checkpoints: atomic writes, verification, keep-last-k, confinement, weights-only loading."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fira_train.files import file_digest
from fira_train.run import checkpoint as ckpt
from tests.fira_train.harness_fixtures import full_disk_at


def _state(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((3, 2), float(step))}, "rng": (3, (1, 2), None),
            "progress": {"tokens": 10 * step}}


def test_round_trip_and_layout(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(tmp_path, 7, _state(7))
    assert path == (tmp_path / "checkpoints" / "step_00000007").resolve()
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "state.pt"]
    marker = json.loads((path / "COMPLETE").read_text())
    assert marker["step"] == 7 and marker["size"] == (path / "state.pt").stat().st_size
    loaded = ckpt.load_checkpoint(tmp_path, path)
    assert torch.equal(loaded["model"]["w"], torch.full((3, 2), 7.0))
    assert loaded["rng"] == (3, (1, 2), None) and loaded["progress"] == {"tokens": 70}
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())


def test_a_mapped_load_reads_the_same_state_without_holding_its_tensors(tmp_path: Path, monkeypatch) -> None:
    """What a check of a checkpoint's records loads (a sweep's check of every run before it
    starts): the same values, its tensors mapped from the file, not copied into memory."""
    path = ckpt.save_checkpoint(tmp_path, 7, _state(7))
    mapped = ckpt.load_checkpoint(tmp_path, path, mmap=True)
    assert torch.equal(mapped["model"]["w"], torch.full((3, 2), 7.0)) and mapped["progress"] == {"tokens": 70}
    asked = []
    load = torch.load

    def spy(*args, **kwargs):
        asked.append(kwargs.get("mmap"))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    ckpt.load_checkpoint(tmp_path, path, mmap=True)
    ckpt.load_checkpoint(tmp_path, path)
    assert asked == [True, False]


def test_a_checkpoint_that_cannot_be_mapped_is_read_whole_not_taken_for_a_damaged_one(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    """A file system that cannot map the file (or a file in torch's legacy format) failed the
    mapped load of a check of its records: the intact checkpoint read as one that 'cannot be
    loaded', and rank 0 chose an older one for every rank of a launch."""
    path = ckpt.save_checkpoint(tmp_path, 7, _state(7))
    load = torch.load

    def unmappable(*args, **kwargs):
        if kwargs.get("mmap"):
            raise RuntimeError("unable to mmap 160 bytes from file <state.pt>: Operation not supported (19)")
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", unmappable)
    loaded = ckpt.load_checkpoint(tmp_path, path, mmap=True)
    assert torch.equal(loaded["model"]["w"], torch.full((3, 2), 7.0)) and loaded["step"] == 7


def test_partial_checkpoints_are_ignored_and_cleaned(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path, 2, _state(2))
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_00000004-123").mkdir()  # killed before the rename
    (root / ".tmp-step_00000004-123" / "state.pt").write_bytes(b"partial")
    (root / "step_00000006").mkdir()  # a step directory without its marker
    (root / "step_00000006" / "state.pt").write_bytes(b"partial")
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [2]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000002"
    removed = {p.name for p in ckpt.remove_partial(tmp_path)}
    assert removed == {".tmp-step_00000004-123", "step_00000006"}
    assert [p.name for p in root.iterdir()] == ["step_00000002"]


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    assert ckpt.latest_checkpoint(tmp_path) is None
    assert ckpt.complete_checkpoints(tmp_path / "missing") == []


def test_requested_checkpoint_missing_raises_file_not_found(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path, 3, _state(3))
    with pytest.raises(FileNotFoundError, match=r"step 5 .*available steps: \[3\]"):
        ckpt.find_checkpoint(tmp_path, 5)
    with pytest.raises(FileNotFoundError):
        ckpt.load_checkpoint(tmp_path, "checkpoints/step_00000009")


def test_truncated_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(tmp_path, 1, _state(1))
    data = (path / "state.pt").read_bytes()
    (path / "state.pt").write_bytes(data[: len(data) // 3])
    with pytest.raises(ckpt.CheckpointError, match="truncated"):
        ckpt.load_checkpoint(tmp_path, path)


def test_corrupted_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(tmp_path, 1, _state(1))
    data = bytearray((path / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    (path / "state.pt").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="corrupted"):
        ckpt.load_checkpoint(tmp_path, path)


def test_broken_marker_is_a_clear_error(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(tmp_path, 1, _state(1))
    (path / "COMPLETE").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="marker"):
        ckpt.load_checkpoint(tmp_path, path)


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_a_pickle_that_runs_code_is_refused(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(tmp_path, 1, _state(1))
    sentinel = tmp_path / "pwned"
    exploit = _Exploit()
    exploit.sentinel = sentinel
    torch_file = path / "state.pt"
    torch.save({"step": 1, "x": exploit}, torch_file)  # a full pickle: loading it runs os.system
    # forge a consistent marker, so only weights_only stands between the file and the exploit
    marker = {"step": 1, "size": torch_file.stat().st_size, "sha256": file_digest(torch_file)}
    (path / "COMPLETE").write_text(json.dumps(marker))
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load_checkpoint(tmp_path, path)
    assert not sentinel.exists()
    torch.load(torch_file, weights_only=False)  # the file really is an exploit
    assert sentinel.exists()


def test_keep_last_k_keeps_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        ckpt.save_checkpoint(tmp_path, step, _state(step))
    deleted = ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in deleted] == ["step_00000001", "step_00000002", "step_00000003"]
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [4, 5]
    ckpt.prune_checkpoints(tmp_path, keep_last=1)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [5]
    with pytest.raises(ValueError, match="keep_last"):
        ckpt.prune_checkpoints(tmp_path, keep_last=0)


def test_keep_last_never_deletes_the_newest_complete_one_for_a_partial(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path, 1, _state(1))
    ckpt.save_checkpoint(tmp_path, 2, _state(2))
    (tmp_path / "checkpoints" / "step_00000003").mkdir()  # partial: newer but incomplete
    ckpt.prune_checkpoints(tmp_path, keep_last=1)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [2]


def test_a_kill_while_an_old_checkpoint_is_pruned_leaves_no_marker_without_its_state(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Pruning deleted an old checkpoint in place, state.pt before its marker: a kill in between
    left a step folder that looked complete and could not load."""
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, _state(step))
    rmtree = ckpt.shutil.rmtree

    def killed_after_the_state_file(path, *args, **kwargs):
        (Path(path) / "state.pt").unlink()
        raise KeyboardInterrupt  # the kill, before the marker goes

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_after_the_state_file)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune_checkpoints(tmp_path, keep_last=1)
    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [2]
    assert [p.name for p in ckpt.remove_partial(tmp_path)] == [".tmp-step_00000001"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
    # a leftover of that name does not stop the next prune
    ckpt.save_checkpoint(tmp_path, 3, _state(3))
    (tmp_path / "checkpoints" / ".tmp-step_00000002").mkdir()
    assert [p.name for p in ckpt.prune_checkpoints(tmp_path, keep_last=1)] == ["step_00000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003"]


def test_paths_are_confined_to_the_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    outside = tmp_path / "elsewhere"
    ckpt.save_checkpoint(outside, 1, _state(1))
    with pytest.raises(ValueError, match="outside the run directory"):
        ckpt.load_checkpoint(run, outside / "checkpoints" / "step_00000001")
    with pytest.raises(ValueError, match="outside the run directory"):
        ckpt.load_checkpoint(run, "../elsewhere/checkpoints/step_00000001")
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_00000009").symlink_to(outside / "checkpoints" / "step_00000001")
    with pytest.raises(ValueError, match="outside the run directory"):
        ckpt.latest_checkpoint(run)


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path, 4, _state(4))
    state = _state(4)
    state["model"]["w"] += 1
    path = ckpt.save_checkpoint(tmp_path, 4, state)
    assert torch.equal(ckpt.load_checkpoint(tmp_path, path)["model"]["w"], torch.full((3, 2), 5.0))


def test_a_kill_while_a_step_is_saved_again_loses_no_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """Saving a step again deleted the old checkpoint in place (state.pt first, the marker last):
    a kill then left a marker without state.pt, which stopped --resume. Now two renames, and a
    kill between them leaves the old copy aside, which the resume puts back."""
    ckpt.save_checkpoint(tmp_path, 3, _state(3))
    ckpt.save_checkpoint(tmp_path, 4, _state(4))
    root = tmp_path / "checkpoints"
    renames = []

    def killed_after_the_first_rename(src, dst):
        if renames:
            raise KeyboardInterrupt  # the kill, between the two renames
        renames.append((src, dst))
        os.replace(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", killed_after_the_first_rename)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 4, _state(40))
    monkeypatch.undo()
    assert not (root / "step_00000004").exists() and (root / ".old-step_00000004" / "COMPLETE").is_file()
    assert [p.name for p in ckpt.recover_swapped(tmp_path)] == ["step_00000004"]
    ckpt.remove_partial(tmp_path)  # the new copy's .tmp- folder
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]
    assert torch.equal(ckpt.load_checkpoint(tmp_path, root / "step_00000004")["model"]["w"], torch.full((3, 2), 4.0))
    # killed while the old copy was being deleted after the swap: the new one stays, the old goes
    old = root / ".old-step_00000004"
    old.mkdir()
    (old / "COMPLETE").write_text("{}")
    assert ckpt.recover_swapped(tmp_path) == [] and not old.exists()


def test_a_failed_write_removes_its_temporary_folder_and_keeps_the_previous_checkpoint(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """A full disk while a checkpoint was written left its ``.tmp-*`` folder, part-written,
    holding disk space until the next resume; now it is removed and the error goes on."""
    ckpt.save_checkpoint(tmp_path, 2, _state(2))
    monkeypatch.setattr(torch, "save", full_disk_at(".tmp-step_00000004", torch.save))
    with pytest.raises(OSError, match="No space left on device") as raised:
        ckpt.save_checkpoint(tmp_path, 4, _state(4))
    assert raised.value.errno == 28
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step_00000002"]  # no .tmp-step_00000004-PID
    assert ckpt.load_checkpoint(tmp_path, ckpt.latest_checkpoint(tmp_path))["step"] == 2
    # a failure to remove it is ignored: the save's own error is the one raised
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda path, ignore_errors=False: None if ignore_errors else 1 / 0)
    with pytest.raises(OSError, match="No space left on device"):
        ckpt.save_checkpoint(tmp_path, 4, _state(4))
    monkeypatch.undo()
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [2]
    ckpt.save_checkpoint(tmp_path, 4, _state(4))  # with room again: saved, the leftover replaced
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]


def test_a_marker_without_its_state_file_is_a_damaged_checkpoint(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(tmp_path, 2, _state(2))
    (path / "state.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match="has no state.pt"):  # --resume falls back past it
        ckpt.load_checkpoint(tmp_path, path)


def test_bad_step_numbers_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step"):
        ckpt.save_checkpoint(tmp_path, -1, _state(0))
