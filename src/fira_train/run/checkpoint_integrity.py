"""Sizes and SHA-256 of a DCP checkpoint's files, recorded in its ``COMPLETE`` marker.

Single-file checkpoints record the size and hash of ``state.pt`` (:mod:`fira_train.run.checkpoint`).
A DCP checkpoint (:mod:`fira_train.run.dist_checkpoint`) holds several files: every rank's shards
(``__RANK_I.distcp``) and rank 0's ``.metadata``. When it is written, each rank hashes the shard
files it wrote, rank 0 the others, and rank 0 records them all in the marker::

    {"format": "torch.distributed.checkpoint", "step": 100, ...,
     "files": {".metadata": {"size": 22811, "sha256": "..."}, "__0_0.distcp": {...}, ...}}

:func:`verify_dcp_checkpoint` checks every recorded file before anything is read from it, and
then parses ``.metadata`` with the restricted unpickler (:mod:`fira_train.run.safe_load`), so a
truncated, altered, missing or empty file is a :class:`~fira_train.run.checkpoint.CheckpointError`
naming it. Checkpoints written before the record existed have no ``"files"``: they are still
loaded (the metadata is still parsed safely), without the hash check.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fira_train.files import parse_json, read_regular_text
from fira_train.run.checkpoint import MARKER, CheckpointError

#: The marker's key for the files' sizes and hashes.
FILES_KEY = "files"
METADATA_FILE = ".metadata"


def file_record(path: Path) -> dict[str, Any]:
    """``{"size", "sha256"}`` of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def sendable(err: Exception) -> Exception:
    """``err`` as other ranks can receive it through a collective, which pickles it (its type,
    errno and file kept, as the command line's one-line messages read them); one that does not
    survive the round trip (an ``__init__`` that takes other arguments fails the load) as a
    ``RuntimeError`` of its text: it would fail on the sending rank alone, or as a TypeError on
    the others, and leave the rest waiting."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 -- any failure of the round trip
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


def raise_on_every_rank(error: Exception | None) -> None:
    """Raise the lowest failing rank's ``error`` on every rank (None: this rank did not fail); a
    barrier where none failed. Every rank must call this.

    A rank that raised alone (a full disk as rank 0 writes the marker, a read error as a rank
    hashes its shards) left the others waiting for it in the next collective, until the process
    group's timeout where no launcher ends them. Errors travel pickled: one that does not survive
    the round trip travels as a ``RuntimeError`` with its text (else it failed on the sending rank
    alone, or as a TypeError on the others); the failing rank raises its own, with its traceback."""
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    sent = None if error is None else sendable(error)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sent)
    failed = [rank for rank, one in enumerate(gathered) if one is not None]
    if failed:
        raise error if failed[0] == dist.get_rank() and error is not None else gathered[failed[0]]


def collect_records(directory: Path, rank: int = 0, world_size: int = 1) -> dict[str, dict[str, Any]]:
    """The records of every file in ``directory`` (a DCP checkpoint being written), on every rank.

    Each rank hashes the shard files it wrote (``__RANK_*``), rank 0 every other file; with
    several processes (a process group), the records are gathered, so the hashing is spread
    over the ranks. Every rank must call this. A rank's failure to read its files (the lowest
    failing rank's) is raised on every rank, so none is left waiting for another.
    """
    directory = Path(directory)
    failure: Exception | None = None
    try:
        files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MARKER)
        shards = tuple(f"__{other}_" for other in range(world_size))
        mine = {p.name: file_record(p) for p in files
                if p.name.startswith(f"__{rank}_") or (rank == 0 and not p.name.startswith(shards))}
    except Exception as err:  # noqa: BLE001 -- a read error: raised on every rank, none left in the gather
        failure, mine = err, {}
    raise_on_every_rank(failure)
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        records = {name: rec for part in gathered for name, rec in part.items()}
    else:
        records = dict(mine)
    return dict(sorted(records.items()))


def read_marker(path: Path) -> dict[str, Any]:
    """The marker of the checkpoint directory ``path`` as a dict; CheckpointError if it is not one."""
    marker_path = Path(path) / MARKER
    try:
        marker = parse_json(read_regular_text(marker_path))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint marker {str(marker_path)!r} is unreadable ({err}): the "
                              "checkpoint is damaged") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"checkpoint marker {str(marker_path)!r} is not a JSON object: the "
                              "checkpoint is damaged")
    return marker


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def verify_files(directory: Path, records: Any) -> None:
    """CheckpointError naming the first recorded file that is missing, has another size or
    another SHA-256 than ``records`` says."""
    directory = Path(directory)
    where = str(directory / MARKER)
    if not isinstance(records, dict) or not records:
        raise CheckpointError(f"the file record in {where!r} is damaged (not a mapping of files)")
    for name, record in sorted(records.items()):
        if not _plain_name(name) or not isinstance(record, dict):
            raise CheckpointError(f"the file record in {where!r} is damaged (entry {name!r})")
        path = directory / name
        try:
            expected_size, expected_hash = int(record["size"]), str(record["sha256"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"the file record in {where!r} is damaged (entry {name!r})") from None
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {str(path)!r} is missing ({MARKER} records it)")
        size = path.stat().st_size
        if size != expected_size:
            raise CheckpointError(f"checkpoint file {str(path)!r} is truncated or altered: {size} bytes, "
                                  f"the marker records {expected_size}")
        if file_record(path)["sha256"] != expected_hash:
            raise CheckpointError(f"checkpoint file {str(path)!r} is corrupted: its SHA-256 does not "
                                  "match the one recorded when it was written")


def verify_dcp_checkpoint(path: Path, marker: dict[str, Any] | None = None) -> Any:
    """Check a complete DCP checkpoint before loading it; returns its parsed ``Metadata``.

    With a file record in the marker: every file's size and hash, ``.metadata`` included (a
    record without it is damaged). Always: ``.metadata`` parsed by the restricted unpickler.
    Raises CheckpointError (:class:`~fira_train.run.safe_load.UnsafeCheckpointError` for a pickle
    that would run code).
    """
    from fira_train.run.safe_load import load_dcp_metadata

    path = Path(path)
    marker = read_marker(path) if marker is None else marker
    records = marker.get(FILES_KEY)
    if records is not None:
        verify_files(path, records)
        if METADATA_FILE not in records:
            raise CheckpointError(f"the file record in {str(path / MARKER)!r} does not cover "
                                  f"{METADATA_FILE}: the checkpoint is damaged")
    metadata_path = path / METADATA_FILE
    if not metadata_path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no {METADATA_FILE} file: it is damaged")
    return load_dcp_metadata(metadata_path)
