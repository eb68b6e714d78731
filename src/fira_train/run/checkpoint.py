"""Atomic, verified checkpoints confined to the run directory.

Layout: ``OUT/checkpoints/step_00000100/`` holds ``state.pt`` (one ``torch.save`` dict of
tensors and plain Python values) and ``COMPLETE`` (JSON: step, size and SHA-256 of
``state.pt``). A checkpoint is written as

1. ``OUT/checkpoints/.tmp-step_00000100-<pid>/state.pt``, flushed and ``fsync``-ed;
2. the ``COMPLETE`` marker, ``fsync``-ed, then the directory itself;
3. ``os.rename`` of the temporary directory to ``step_00000100`` and an ``fsync`` of the parent.

A process killed at any point leaves either no ``step_*`` directory or a complete one; leftover
``.tmp-*`` directories are ignored (and removed by :func:`remove_partial`). A save that fails with
an error (a full disk) removes its ``.tmp-*`` directory before the error goes on. A step saved again
replaces its checkpoint by two renames (:func:`install_dir`), so a kill never leaves it half
deleted; a resume first puts back one a kill left aside (:func:`recover_swapped`). Loading verifies the
marker, the size and the hash before ``torch.load(weights_only=True)``, so a truncated or
corrupted file raises :class:`CheckpointError` and nothing is loaded. Only the newest
``keep_last`` complete checkpoints are kept, and never the newest one deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from fira_train.files import file_digest, fsync_dir, parse_json, read_regular_text, write_synced

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "state.pt"
MARKER = "COMPLETE"
_NAME = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (incomplete, truncated, corrupted, foreign)."""


def checkpoint_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return f"step_{step:08d}"


def checkpoint_step(path: str | Path) -> int:
    """The step of the checkpoint directory ``path`` (``step_XXXXXXXX``); ValueError for another name."""
    match = _NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"{str(path)!r} is not a checkpoint directory (step_XXXXXXXX)")
    return int(match.group(1))


def _root(run_dir: str | Path) -> Path:
    return Path(run_dir).resolve() / CHECKPOINT_DIR


def _confined(run_dir: str | Path, path: Path) -> Path:
    """``path`` resolved (symlinks followed); ValueError if it leaves the run directory."""
    base = Path(run_dir).resolve()
    resolved = path.resolve()
    if resolved != base and base not in resolved.parents:
        raise ValueError(f"checkpoint path {str(path)!r} is outside the run directory {str(base)!r}")
    return resolved


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically as the checkpoint of ``step``; returns its directory."""
    root = _root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = _confined(run_dir, root / checkpoint_name(step))
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        state_path = tmp / STATE_FILE
        write_synced(state_path, lambda f: torch.save(state, f))
        marker = {"step": step, "size": state_path.stat().st_size, "sha256": file_digest(state_path)}
        write_synced(tmp / MARKER, lambda f: json.dump(marker, f), binary=False)
        fsync_dir(tmp)
        install_dir(tmp, final)
        fsync_dir(root)
    except BaseException:
        discard_partial(tmp)
        raise
    return final


def discard_partial(tmp: Path) -> None:
    """Remove ``tmp``, the temporary folder of a save that failed (a full disk, Ctrl-C), so that
    its part-written files do not hold disk space until the next resume (:func:`remove_partial`).
    Best effort: a failure to remove it is ignored, so the save's own error is the one raised.
    Gone already where the failure came after the rename into place."""
    shutil.rmtree(tmp, ignore_errors=True)


#: Prefix of a checkpoint being replaced by a new save of its step (:func:`install_dir`).
OLD_PREFIX = ".old-"


def install_dir(tmp: Path, final: Path) -> None:
    """Rename the complete directory ``tmp`` to ``final``. An existing ``final`` (a step saved
    again: a resumed run that ends where it started, or one that skipped a damaged newest
    checkpoint) is renamed to ``.old-<name>`` first and deleted after, never deleted in place: a
    kill in between leaves a complete copy, which :func:`recover_swapped` puts back."""
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.with_name(OLD_PREFIX + final.name)
    if old.exists():
        shutil.rmtree(old)
    os.rename(final, old)
    os.rename(tmp, final)
    # the new one is in place: a failure to delete the old copy (a busy network file) must not
    # fail the save, which under torchrun would leave the other ranks waiting; a resume deletes it
    shutil.rmtree(old, ignore_errors=True)


def recover_swapped(run_dir: str | Path) -> list[Path]:
    """Finish the replacements (:func:`install_dir`) that a kill interrupted; the checkpoints
    put back. A complete ``.old-step_N`` without a complete ``step_N`` (the kill fell between
    the two renames) becomes ``step_N`` again; every other ``.old-*`` is deleted."""
    root = _root(run_dir)
    if not root.is_dir():
        return []
    restored = []
    for child in sorted(root.iterdir()):
        name = child.name[len(OLD_PREFIX):]
        if not (child.name.startswith(OLD_PREFIX) and _NAME.match(name) and child.is_dir()):
            continue
        final = _confined(run_dir, root / name)
        if (child / MARKER).is_file() and not (final / MARKER).is_file():
            if final.exists():
                shutil.rmtree(final)
            os.rename(child, final)
            restored.append(final)
        else:
            shutil.rmtree(_confined(run_dir, child))
    if restored:
        fsync_dir(root)
    return restored


def marked_step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every ``step_XXXXXXXX`` directory directly under ``root`` that
    has a completion marker, oldest first: the layout shared with
    :mod:`fira_train.run.dist_checkpoint`."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and (child / MARKER).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every checkpoint with a completion marker, oldest first."""
    return [(step, _confined(run_dir, path)) for step, path in marked_step_dirs(_root(run_dir))]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint's directory, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def find_checkpoint(run_dir: str | Path, step: int) -> Path:
    """The complete checkpoint of ``step``; FileNotFoundError if there is none."""
    path = _confined(run_dir, _root(run_dir) / checkpoint_name(step))
    if not (path / MARKER).is_file():
        available = [s for s, _ in complete_checkpoints(run_dir)]
        raise FileNotFoundError(
            f"no complete checkpoint for step {step} in {str(_root(run_dir))!r}; available steps: "
            f"{available or 'none'}")
    return path


def load_checkpoint(run_dir: str | Path, path: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """Verify and load a checkpoint directory (inside ``run_dir``) into memory; with ``mmap``, its
    tensors mapped from the file instead (read only where touched: a check of its records).

    Raises FileNotFoundError if it does not exist, :class:`CheckpointError` if it is
    incomplete, truncated or corrupted, ValueError if it lies outside ``run_dir``.
    """
    directory = Path(path)
    if not directory.is_absolute():
        directory = Path(run_dir) / directory
    directory = _confined(run_dir, directory)
    state_path = directory / STATE_FILE
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint {str(directory)!r} does not exist")
    if not state_path.exists():
        raise CheckpointError(f"checkpoint {str(directory)!r} has no {STATE_FILE} (deleted, or interrupted "
                              "while being replaced)")
    try:
        marker = parse_json(read_regular_text(directory / MARKER))
        expected_size, expected_hash = int(marker["size"]), str(marker["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {str(directory)!r} has no valid {MARKER} marker "
                              f"(interrupted while being written?): {err}") from None
    size = state_path.stat().st_size
    if size != expected_size:
        raise CheckpointError(f"checkpoint file {str(state_path)!r} is truncated or altered: "
                              f"{size} bytes, the marker records {expected_size}")
    if file_digest(state_path) != expected_hash:
        raise CheckpointError(f"checkpoint file {str(state_path)!r} is corrupted: its SHA-256 does "
                              "not match the one recorded when it was written")
    try:
        state = _load(state_path, mmap)
    except Exception as err:  # the unpickler's errors vary by failure; all mean "unusable"
        from fira_train.run.safe_load import unsafe_pickle_error

        unsafe = unsafe_pickle_error(err, state_path)
        if unsafe is not None:  # a pickle that would run code: refused, named as such
            raise unsafe from None
        raise CheckpointError(f"checkpoint file {str(state_path)!r} cannot be loaded: {err}") from err
    if not isinstance(state, dict) or state.get("step") != marker.get("step"):
        raise CheckpointError(f"checkpoint file {str(state_path)!r} does not hold the state of "
                              f"step {marker.get('step')}")
    return state


def _load(state_path: Path, mmap: bool) -> Any:
    """``state_path`` loaded, its tensors mapped from the file with ``mmap``; read whole where it
    cannot be mapped (a file system without mmap, a file in torch's legacy format): an intact
    checkpoint is not taken for a damaged one (an older one resumed in its place) for a check of
    its records alone. A file that cannot be read whole either raises that read's error."""
    if mmap:
        try:
            return torch.load(state_path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - the full read below says what is wrong with it, if anything
            pass
    return torch.load(state_path, map_location="cpu", weights_only=True, mmap=False)


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints; returns the deleted ones.

    The newest complete checkpoint is never deleted, whatever ``keep_last`` is.
    """
    return delete_oldest([path for _, path in complete_checkpoints(run_dir)], keep_last)


def delete_oldest(paths: list[Path], keep_last: int) -> list[Path]:
    """Delete all but the last ``keep_last`` of ``paths`` (checkpoint directories, oldest
    first); returns the deleted ones. Each is renamed to ``.tmp-<name>`` before it is deleted:
    deleted in place, a kill part-way left a ``step_*`` folder whose marker had outlived its
    files (a complete-looking checkpoint that cannot load); a ``.tmp-*`` leftover is ignored and
    removed by :func:`remove_partial`."""
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    doomed = paths[:-keep_last]
    for path in doomed:
        aside = path.with_name(".tmp-" + path.name)
        if aside.exists():  # left by a kill while an earlier prune deleted it
            shutil.rmtree(aside)
        os.rename(path, aside)
        shutil.rmtree(aside)
    return doomed


def remove_partial(run_dir: str | Path) -> list[Path]:
    """Delete leftovers of interrupted writes (``.tmp-*`` directories and unmarked ``step_*``)."""
    root = _root(run_dir)
    if not root.is_dir():
        return []
    removed = []
    for child in root.iterdir():
        partial = child.name.startswith(".tmp-") or (_NAME.match(child.name) and not (child / MARKER).exists())
        if partial and child.is_dir():
            shutil.rmtree(_confined(run_dir, child))
            removed.append(child)
    return removed
