"""Content-addressed on-disk cache for tokenizers and tokenized corpora.

Every cache entry is a directory named by a hash of what produced it (corpus content, split,
tokenizer, recipe version). Entries are written into a temporary sibling directory, flushed to
disk, then renamed into place: a reader therefore sees either a complete entry or none, even
if the writer is killed half-way (``kill -9``) or two processes build the same entry at once.
A temporary directory records its writer (:data:`WRITER_FILE`), so that one left by a killed
writer is removed by a later write, and nothing else is (:func:`_remove_abandoned`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from fira_train.files import file_digest, fsync_dir, read_regular_text

CACHE_ENV_VAR = "FIRA_CACHE"
#: The cache folder's own folders: trained tokenizers, tokenized corpora, and the token digests
#: of streamed ones. Never part of a local corpus (:func:`fira_train.data.build.build_corpus`).
TOKENIZERS, TOKENS, TOKEN_DIGESTS = "tokenizers", "tokens", "token-digests"
CACHE_FOLDERS = (TOKENIZERS, TOKENS, TOKEN_DIGESTS)
#: Seconds after which a ``.tmp-*`` folder that another machine writes, and nothing was written
#: into, is taken for a killed writer's: a live writer writes into it until done (a tokenizer once
#: it is trained, a token cache a chunk of documents at a time). A writer on this machine is asked
#: instead (:func:`_remove_abandoned`).
ABANDONED_AFTER_S = 3600
TEMP_PREFIX = ".tmp-"
#: The file in a ``.tmp-*`` folder that names its writer (``{"host", "pid"}``): only folders
#: holding it are ever removed by another process. The entry is written in a subfolder beside it.
WRITER_FILE = "fira-train-writer.json"


def default_cache_dir() -> Path:
    """``$FIRA_CACHE`` if set, else ``~/.cache/fira-train``."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fira-train"


class CacheNotWritableError(OSError):
    """A cache folder in which nothing can be made (read-only, not the user's, a file in the way),
    found before the work whose result it would hold. Its errno and filename are the failed
    write's; its message names the setting that chose the folder."""

    def __str__(self) -> str:
        return (f"the cache folder {self.filename} cannot be written ({self.strerror}): set data.cache_dir "
                f"(or ${CACHE_ENV_VAR}) to a folder you can write")


def require_writable(folder: Path) -> None:
    """Make ``folder`` (with its parents) and a folder in it, then remove that one: a cache that
    cannot be written is refused before a tokenizer is trained or a corpus tokenized for it
    (:class:`CacheNotWritableError`), not after, when the work is lost. Called on a cache miss
    only: a cache that holds what a build needs is read, writable or not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=folder))
    except OSError as exc:
        raise CacheNotWritableError(exc.errno, exc.strerror, exc.filename or str(folder)) from exc


def fingerprint(*parts: object) -> str:
    """A short stable hash of JSON-serialisable ``parts`` (key order does not matter)."""
    payload = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:24]


def file_digests(directory: Path, names: tuple[str, ...]) -> dict[str, str]:
    """``{name: SHA-256}`` of the files ``names`` in ``directory`` (recorded in an entry's metadata)."""
    return {name: file_digest(directory / name) for name in names}


def check_digests(directory: Path, recorded: object, names: tuple[str, ...]) -> None:
    """ValueError naming the first of ``names`` whose SHA-256 differs from ``recorded`` (the
    ``{name: digest}`` written with the entry), or if there is no such record (an entry written
    before digests were recorded cannot be trusted either)."""
    if not isinstance(recorded, dict):
        raise ValueError("it records no digests of its files (written by an older fira-train)")
    for name in names:
        if recorded.get(name) != file_digest(directory / name):
            raise ValueError(f"{name} does not match the SHA-256 recorded when it was written")


def save_pieces(path: Path, pieces: Iterable[np.ndarray], dtype: np.dtype) -> int:
    """Write the 1-D ``pieces`` (of ``dtype``) one after another as one ``.npy`` array at ``path``,
    one piece in memory at a time; return its length.

    The header is written first for no elements and again at the end for all of them (numpy pads
    it so that the length can grow in place): a corpus's ids joined in memory before ``np.save``
    were held twice at the join, the largest allocation of a cold build. And a failed write is an
    OSError with its errno and ``path``: numpy's ``ndarray.tofile`` reports a short write (a full
    disk, a file-size limit) without either ("2304053 requested and 1032128 written"), so the user
    saw neither that the cache was full nor where.
    """
    dtype = np.dtype(dtype)

    def header(length: int) -> bytes:
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(buffer, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                      "fortran_order": False, "shape": (length,)})
        return buffer.getvalue()

    total = 0
    try:
        with open(path, "wb") as handle:
            handle.write(header(0))
            for piece in pieces:
                piece = np.ascontiguousarray(piece, dtype=dtype).reshape(-1)
                handle.write(memoryview(piece).cast("B"))
                total += len(piece)
            final = header(total)
            if len(final) != len(header(0)):  # numpy leaves room for 21 digits; a guard all the same
                raise ValueError(f"{path}: the .npy header of {total} elements does not fit in place")
            handle.seek(0)
            handle.write(final)
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    return total


def _fsync_tree(root: Path) -> None:
    # Flush file contents before the rename publishes them: otherwise a crash right after the
    # rename can leave a complete-looking entry whose files are empty.
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    with contextlib.suppress(OSError):  # directories cannot be fsynced on every platform
        fsync_dir(root)


def this_host() -> str:
    """This machine as a writer records it: its host name and, where there is one (Linux), its
    process-id namespace: containers on one machine may share a host name, not process ids."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()} {namespace}".strip()


def _writer_gone(folder: Path, host: str, deadline: float) -> bool:
    """Whether the ``.tmp-*`` ``folder`` is provably a killed writer's: it names its writer
    (:data:`WRITER_FILE`; a folder without one is not ours, or its writer is still making it),
    and that process is gone (on this machine), or (on another, which cannot be asked) nothing in
    the folder was touched since ``deadline``."""
    try:
        writer = json.loads(read_regular_text(folder / WRITER_FILE))
        pid = writer["pid"]
        if type(pid) is not int or pid <= 0:  # 0 and -1 would signal groups: not a writer's record
            return False
        if writer["host"] == host:
            try:
                os.kill(pid, 0)  # signal 0: only whether the process exists
            except ProcessLookupError:
                return True
            except PermissionError:  # another user's live process
                return False
            return False
        touched = max(p.lstat().st_mtime for p in [folder, *folder.rglob("*")])
    except (OSError, ValueError, KeyError, TypeError):  # removed meanwhile, or not a record of ours
        return False
    return touched < deadline


def _remove_abandoned(parent: Path, own: Path) -> None:
    """Remove the temporary folders in ``parent`` whose writer is provably gone
    (:func:`_writer_gone`): a writer killed before its ``finally`` (``kill -9``, the out-of-memory
    killer, a scheduler's SIGTERM) left one for ever, never used and as large as a tokenized
    corpus. A writer on this machine that is stopped (SIGSTOP, a laptop asleep) keeps its folder
    however long; one on another machine (a cache shared by machines), after
    :data:`ABANDONED_AFTER_S` without a write, does not. A ``.tmp-*`` folder that fira-train did
    not write (a user's) is never removed.

    The age is measured on the file system's clock, not this machine's: ``own``, the folder this
    write has just made, carries the time it stamps now. On a network file system the server
    stamps every writer's files, and a machine whose clock ran an hour ahead of it took a live
    writer's folder for an abandoned one (and removed it under that writer)."""
    try:
        deadline = own.stat().st_mtime - ABANDONED_AFTER_S
    except OSError:
        return
    host = this_host()
    with contextlib.suppress(OSError):  # a folder that cannot be listed: nothing to tidy
        for child in parent.iterdir():
            if (not child.name.startswith(TEMP_PREFIX) or child.name == own.name or child.is_symlink()
                    or not child.is_dir()):
                continue
            if _writer_gone(child, host, deadline):
                shutil.rmtree(child, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces nothing and becomes ``final`` on success.

    If ``final`` appeared meanwhile (another process built the same entry), the temporary copy
    is discarded: entries are content-addressed, so both copies are equivalent. On an exception
    the temporary directory is removed and ``final`` is left untouched; one left by a writer that
    was killed is removed by a later write into the same folder (:func:`_remove_abandoned`).
    The yielded directory lies in a ``.tmp-*`` folder beside the record of its writer
    (:data:`WRITER_FILE`), which the entry therefore does not hold.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.parent / f"{TEMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temp.mkdir()
    try:
        record = temp / WRITER_FILE
        try:
            record.write_text(json.dumps({"host": this_host(), "pid": os.getpid()}))
        except OSError as exc:  # a full disk fails at the close, an error that names no file
            if exc.filename is not None or exc.errno is None:
                raise
            raise OSError(exc.errno, exc.strerror, str(record)) from exc
        entry = temp / "entry"
        entry.mkdir()
        _remove_abandoned(final.parent, temp)
        yield entry
        _fsync_tree(entry)
        try:
            os.rename(entry, final)
        except OSError:
            if not final.is_dir():
                raise
            # lost the race to an identical entry: ours goes with the temporary folder
    finally:
        shutil.rmtree(temp, ignore_errors=True)
