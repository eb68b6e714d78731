"""File helpers shared by the layers: a file's SHA-256 and a directory's fsync (the checkpoints
and the data cache), whole-file writes that a crash cannot leave half-written, the run's JSON
files, and the check that a folder command does not replace a report it did not write
(:func:`check_report_owner`).

The run's JSON files are written without ``NaN`` / ``Infinity`` and read back naming the file.
Python's ``json`` writes ``float("inf")`` as ``Infinity`` and ``nan`` as ``NaN``, which is not
JSON (``jq``, JavaScript and most other readers refuse the file). :func:`dumps` writes ``null``
for every non-finite float instead, so readers of ``metrics.jsonl``, ``summary.json`` and
``results.json`` must accept ``None`` where they expect a number (an old file may still hold
``Infinity``, which :func:`read_json` reads back as ``inf``).

:func:`read_json` and :func:`read_json_lines` raise :class:`DamagedFileError` naming the file
(and line) and what to do, where ``json`` would raise a bare ``JSONDecodeError`` naming neither.

Every record file is read with a size cap (:func:`read_regular_bytes`: :data:`RECORD_LIMIT`),
and JSON-lines logs line by line (:func:`json_lines`: each line up to :data:`RECORD_LIMIT`, the
file up to :data:`LINES_LIMIT`): a larger file, which fira-train never writes (a crafted one, or a
sparse one whose size costs no disk), is refused naming its size and the limit
(:class:`FileTooLargeError`), never read whole into memory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import math
import os
import stat
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import IO, Any, TextIO

try:
    import fcntl
except ImportError:  # Windows: no advisory locks
    fcntl = None  # type: ignore[assignment]

__all__ = ["LINES_LIMIT", "RECORD_LIMIT", "RUN_LOCK_FILE", "DamagedFileError", "FileTooLargeError",
           "check_report_owner", "cut_back_json_lines", "dumps", "file_digest", "finite_or_none", "fsync_dir",
           "json_lines", "locked", "open_regular", "parse_json", "read_json", "read_json_lines", "read_regular_bytes",
           "read_regular_text", "refuse_links", "write_atomic", "write_text_atomic"]


#: The lock file in every run's folder (:mod:`fira_train.run.run_lock`), kept after the run: it
#: marks a folder as a fira-train run's, which the listing of a local corpus leaves out.
RUN_LOCK_FILE = ".fira-train.lock"
#: The run spec an analysis (``fira_train.analysis``) writes into each of its runs' folders, named
#: here, below the commands, so that another command (compare) can tell an analysis's run.
ANALYSIS_RUN_FILE = "analysis_run.json"


def measure_out_dir(out: str | None, recipe: str) -> str:
    """Where ``fira-train memory --measure`` writes: ``--out``, else ``runs/<recipe>-memory`` (the
    recipe's name in lower case, as recipes are looked up)."""
    return str(out) if out else f"runs/{(recipe or 'recipe').lower()}-memory"  # no recipe: memory without --measure


#: The most characters of a ``report.md``'s first line read to tell who wrote it (a heading).
_FIRST_LINE = 4096


def report_heading(out: str | os.PathLike[str], name: str = "report.md") -> str:
    """The first line of ``out/<name>`` (its heading: who wrote it), ``""`` if there is none."""
    report = Path(out) / name
    if not report.is_file():
        return ""
    with open(report, encoding="utf-8", errors="replace") as handle:
        return handle.readline(_FIRST_LINE).rstrip("\n")  # a line without end (a sparse file) is not read whole


def check_report_owner(out: str | os.PathLike[str], titles: tuple[str, ...], command: str, *,
                       overwrite: bool | None = None, writer: str | None = None, name: str = "report.md") -> None:
    """``FileExistsError`` if ``out/report.md`` exists and was not written by ``command``: its
    first line begins with none of ``titles`` (the headings ``command`` writes) and it is not
    empty. So a folder
    command (compare, sweep, an analysis) run on another command's ``--out``, or on a folder with
    a ``report.md`` of the user's, does not replace that report. ``overwrite``: True lets it
    (the command's ``--overwrite``); None: the command has no such flag. ``writer``: how the
    error names what did not write it (default: the command). ``name``: the report's file name
    (``memory --measure`` writes ``memory.md``)."""
    report = Path(out) / name
    if overwrite or not report.is_file() or report.stat().st_size == 0:  # an empty one holds nothing to keep
        return
    first = report_heading(out, name)
    if first.startswith(titles):
        return
    how = "choose another --out" + (", or pass --overwrite to replace it" if overwrite is not None else "")
    writer = writer or f"`fira-train {command}`"
    raise FileExistsError(f"--out {str(out)!r} holds a {name} that {writer} did not write "
                          f"(it begins {first[:60]!r}); {how}")


def file_digest(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes (hex), read in chunks so large files need no extra memory;
    ValueError naming ``path`` if it is not a regular file (:func:`open_regular`)."""
    digest = hashlib.sha256()
    with open(open_regular(path, os.O_RDONLY, follow=True), "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it) to disk, where the platform allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: ``os.O_NOFOLLOW`` where the platform has it: an open that fails on a symbolic link.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def refuse_links(root: str | Path, names: Collection[str] | None = None) -> None:
    """ValueError naming what below ``root`` is a link: a symbolic link (``root`` itself may be
    one: the user's own ``--out``), or a file with other hard links; PermissionError naming a
    folder below it that cannot be listed. fira-train makes none of these; in a run folder from
    elsewhere (a download, a shared drive, an archive) one could point the run's writes, or its
    clean-ups, at a file outside the folder. ``names``: only the entries of ``root`` so named (or
    named so plus ``.tmp``, a write interrupted) and what they hold: those a command writes, where
    ``root`` may hold the user's own files too. What vanishes while it is looked at (another
    process's temp file) is passed over."""
    root = Path(root)
    if not root.is_dir():
        return

    def unreadable(err: OSError) -> None:  # os.walk would skip the folder, and what it holds
        if isinstance(err, FileNotFoundError):
            return
        raise PermissionError(f"{str(root)!r} holds a folder fira-train cannot list ({err.filename!r}: "
                              f"{err.strerror}): make it readable, or choose another --out") from None

    def kind(path: Path) -> str | None:
        """"link" (symbolic, or a file with other hard links), "special" (neither a file, a folder
        nor a link: os.walk lists it among the files), else None; from one lstat."""
        try:
            info = path.lstat()
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_nlink > 1):
            return "link"
        return None if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode) else "special"

    found: dict[str, list[Path]] = {"link": [], "special": []}
    for folder, folders, files in os.walk(root, onerror=unreadable):  # into no linked folder
        if names is not None and Path(folder) == root:
            ours = {n for n in names} | {f"{n}.tmp" for n in names}
            folders[:] = [n for n in folders if n in ours]
            files = [n for n in files if n in ours]
        for name in folders + files:
            path = Path(folder, name)
            what = kind(path)
            if what is not None:
                found[what].append(path)
    links, specials = found["link"], found["special"]
    if links:
        raise ValueError(f"{str(root)!r} holds links ({_shown(links)}: symbolic, or files with other hard links): "
                         "fira-train makes none, and in a folder from elsewhere one could send the run's writes "
                         "or deletions to a file outside it; choose another --out (a run folder from elsewhere: "
                         "copy it without them)")
    if specials:
        raise ValueError(f"{str(root)!r} holds entries that are neither files nor folders ({_shown(specials)}: a "
                         "FIFO, a socket or a device): fira-train makes none, and in a folder from elsewhere one "
                         "could hang the run (a FIFO is read or written only with another process at its other end) "
                         "or send its writes to a device; choose another --out (a run folder from elsewhere: copy "
                         "it without them)")


def _shown(paths: list[Path]) -> str:
    return ", ".join(repr(str(p)) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def open_regular(path: str | Path, flags: int, mode: int = 0o666, follow: bool = False) -> int:
    """``os.open(path, flags | O_NOFOLLOW)``, refused (ValueError naming it) unless it is a regular
    file: a FIFO planted after :func:`refuse_links` looked would block the open (for writing, until
    a reader comes) or the writes, or the reads (until a writer comes), a device take the writes or
    give endless reads. Opened without blocking, checked, and set blocking again. ``follow``: a
    symbolic link is followed (for reads: a link sends no write anywhere)."""
    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | (0 if follow else NOFOLLOW) | nonblock, mode)
    except OSError as err:
        if err.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise ValueError(_not_regular(path)) from None
        raise
    try:
        kind = os.fstat(fd).st_mode
        if stat.S_ISDIR(kind):  # opened for reading: the error reading a folder gives, as open() would
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(kind):
            raise ValueError(_not_regular(path))
        if nonblock:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str | Path) -> TextIO:
    """``path`` opened for appending UTF-8 text (created if missing), through :func:`open_regular`:
    never through a symbolic link planted in its place, nor into a FIFO or a device."""
    return os.fdopen(open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


def _not_regular(path: str | Path) -> str:
    return (f"{str(path)!r} is not a file (a FIFO, a socket or a device): fira-train makes none, and one could "
            "hang the run or send its writes to a device; remove it, or choose another --out")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Replace ``path``'s content with ``text``: written to ``<name>.tmp`` beside it, flushed to
    disk, then renamed over it, so a reader (or a run resumed after a crash) sees the old file or
    the new one, never a part. One writer per path at a time (a run's lock, a sweep's driver)."""
    return write_atomic(path, lambda handle: handle.write(text), binary=False)


def write_atomic(path: str | Path, write: Callable[[IO[Any]], Any], *, binary: bool = True) -> Path:
    """Replace ``path``'s content with what ``write(handle)`` writes (a binary handle, or a UTF-8
    text one with ``binary=False``), as :func:`write_text_atomic` does: to ``<name>.tmp``, flushed
    to disk, renamed over ``path``; on an error the part-written file is removed."""
    path = Path(path)
    temp = path.with_name(path.name + ".tmp")
    try:
        # a temp file left there (or a link planted as one) is removed, never written through
        # ("x": O_CREAT | O_EXCL, which fails on any link); the rename then replaces ``path``
        # itself, a link there included
        temp.unlink(missing_ok=True)
        write_synced(temp, write, binary=binary, exclusive=True)
        os.replace(temp, path)
    except BaseException:  # a full disk: no part-written file left beside the old one
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # the rename itself
    return path


def write_synced(path: str | Path, write: Callable[[IO[Any]], Any], *, binary: bool = True,
                 exclusive: bool = False) -> None:
    """Create or truncate ``path`` (``exclusive``: create only, failing on anything there, a link
    included), ``write(handle)`` into it (a binary handle, or a UTF-8 text one with
    ``binary=False``) and flush it to disk (``fsync``) before returning: what a rename that
    publishes it, or a completion marker beside it, relies on."""
    mode = ("x" if exclusive else "w") + ("b" if binary else "")
    with open(path, mode) if binary else open(path, mode, encoding="utf-8") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


@contextlib.contextmanager
def locked(lock_file: str | Path) -> Iterator[None]:
    """Hold a blocking, exclusive ``flock`` on ``lock_file`` (created if missing): around a
    read-change-write of a file that several processes update, so none loses what another wrote.
    The file stays (removing a lock file others wait on is a race). Without ``fcntl`` (Windows)
    nothing is locked: one writer at a time there."""
    if fcntl is None:
        yield
        return
    with open_append(lock_file) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class DamagedFileError(ValueError):
    """A JSON file that cannot be read back; the message names it and says what to do."""

    def __init__(self, path: str | Path, reason: str, hint: str = "") -> None:
        self.path, self.reason, self.hint = str(path), reason, hint
        super().__init__(f"{self.path} is damaged ({reason})" + (f"; {hint}" if hint else ""))

    def __reduce__(self) -> tuple:  # crosses process boundaries (analysis workers)
        return (type(self), (self.path, self.reason, self.hint))


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists and tuples) replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` that writes ``null`` for NaN and infinities (never ``NaN`` / ``Infinity``)."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)


def json_error_message(err: json.JSONDecodeError) -> str:
    """``err``'s message, for a place to follow: without the " at" that some end with
    (``Invalid control character at``), which read "at at column 15"."""
    return err.msg.removesuffix(" at")


def _reason(err: ValueError, offset: int = 0) -> str:
    """What ``err`` found wrong with a file; ``offset``: where in the file the decoded bytes start."""
    if isinstance(err, UnicodeDecodeError):
        return f"not UTF-8 text: byte {err.object[err.start]:#04x} at offset {offset + err.start}"
    if isinstance(err, json.JSONDecodeError):
        return f"not valid JSON: {json_error_message(err)} at line {err.lineno} column {err.colno}"
    return str(err)


def parse_json(text: str) -> Any:
    """``json.loads(text)``; JSON nested too deeply for Python's parser (``[`` a few thousand times:
    a crafted file) is a ``json.JSONDecodeError`` like other invalid JSON, where ``json.loads``
    raised ``RecursionError``, which every reader let through as a traceback."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None


def read_json(path: str | Path, hint: str = "") -> Any:
    """The JSON value in ``path``; :class:`DamagedFileError` (with ``hint``) if it cannot be parsed."""
    text = _read_text(path, hint)
    try:
        return parse_json(text)
    except ValueError as err:  # JSONDecodeError
        raise DamagedFileError(path, _reason(err), hint) from None


def cut_back_json_lines(path: str | Path, step: int, hint: str = "") -> None:
    """Keep the lines of a per-step JSON-lines log (``metrics.jsonl``, an analysis's records)
    whose ``"step"`` is at most ``step`` (a run resumed from that step's checkpoint), in one atomic
    rewrite streamed line by line (:func:`json_lines`); the lines kept are not re-encoded. A last
    line without its newline was cut by a kill while it was written, after that checkpoint (a
    step's line comes before its checkpoint): it goes too. :class:`DamagedFileError` names any
    other line that cannot be parsed."""
    path = Path(path)

    def write(handle: IO[bytes]) -> None:
        for number, line, record in _parsed_lines(path, hint, complete_only=True):
            recorded = record.get("step", 0) if isinstance(record, dict) else None
            # a step of another type (a string, null: an edited or foreign file) failed the comparison
            # below with a TypeError's traceback
            if not isinstance(recorded, (int, float)) or isinstance(recorded, bool):
                raise DamagedFileError(path, f"line {number} is not a step's record", hint)
            if recorded <= step:
                handle.write(line)

    write_atomic(path, write)


def read_json_lines(path: str | Path, hint: str = "") -> list[Any]:
    """The values of a JSON-lines file (blank lines skipped), read line by line
    (:func:`json_lines`); :class:`DamagedFileError` naming the first line that cannot be parsed."""
    return [record for _, _, record in _parsed_lines(path, hint)]


#: The most bytes fira-train reads from one of its record files (a run's ``config.json`` and
#: ``summary.json``, a checkpoint's ``COMPLETE`` marker, a cache entry's record of SHA-256, a
#: sweep's or an analysis's record) or from one line of a JSON-lines log: those it writes hold
#: kilobytes. A larger one (a crafted file, a sparse one of any apparent size) is refused
#: before it is read (:class:`FileTooLargeError`), instead of being read whole into memory.
RECORD_LIMIT = 64 << 20
#: The most bytes of a JSON-lines log (``metrics.jsonl``: one short line per step; an analysis's
#: per-step records), which grows with its run and is read line by line.
LINES_LIMIT = 16 << 30


class FileTooLargeError(DamagedFileError):
    """A file larger than fira-train reads for its kind (:data:`RECORD_LIMIT`,
    :data:`LINES_LIMIT`): none it writes comes near; the message names the file, its size (at
    least ``size`` bytes: read up to the limit) and the limit."""

    def __init__(self, path: str | Path, size: int, limit: int, hint: str = "", line: int | None = None) -> None:
        self.size, self.limit, self.line = size, limit, line
        where = f"its line {line} is over" if line is not None else f"it is {size} bytes, over"
        super().__init__(path, f"too large: {where} the {limit} bytes fira-train reads from such a file "
                               "(none it writes comes near)", hint)

    def __reduce__(self) -> tuple:
        return (type(self), (self.path, self.size, self.limit, self.hint, self.line))


def read_regular_text(path: str | Path, limit: int = RECORD_LIMIT, hint: str = "") -> str:
    """``path``'s UTF-8 text (:func:`read_regular_bytes`, decoded; ``UnicodeDecodeError`` if it
    is not UTF-8)."""
    return read_regular_bytes(path, limit, hint).decode("utf-8")


def read_regular_bytes(path: str | Path, limit: int = RECORD_LIMIT, hint: str = "") -> bytes:
    """``path``'s bytes; ValueError naming it if it is not a regular file (a FIFO planted in a
    run folder while the run trains would block the read for good, a device give endless bytes),
    :class:`FileTooLargeError` (with ``hint``) if it holds more than ``limit`` bytes: its size is
    looked at before it is read, and at most ``limit + 1`` bytes are read (it may grow meanwhile)."""
    with _open_capped(path, limit, hint) as handle:
        data = handle.read(limit + 1)
        if len(data) > limit:
            raise FileTooLargeError(path, max(len(data), os.fstat(handle.fileno()).st_size), limit, hint)
    return data


@contextlib.contextmanager
def _open_capped(path: str | Path, limit: int, hint: str) -> Iterator[IO[bytes]]:
    """``path`` opened for reading in binary, once it is known to be a regular file (ValueError
    otherwise: :func:`open_regular`) of at most ``limit`` bytes (:class:`FileTooLargeError`)."""
    with open(open_regular(path, os.O_RDONLY, follow=True), "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise FileTooLargeError(path, size, limit, hint)
        yield handle


def json_lines(path: str | Path, hint: str = "") -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of the JSON-lines file ``path``, its newline kept, one line in
    memory at a time (a last line may lack its newline); :class:`FileTooLargeError` for a file
    over :data:`LINES_LIMIT` bytes (looked at before reading, and counted as read) or a line over
    :data:`RECORD_LIMIT`; ValueError if it is not a regular file (:func:`read_regular_bytes`)."""
    with _open_capped(path, LINES_LIMIT, hint) as handle:
        total = 0
        for number in itertools.count(1):
            line = handle.readline(RECORD_LIMIT + 1)
            if not line:
                return
            total += len(line)
            if len(line) > RECORD_LIMIT:
                raise FileTooLargeError(path, max(total, os.fstat(handle.fileno()).st_size), RECORD_LIMIT, hint,
                                        line=number)
            if total > LINES_LIMIT:
                raise FileTooLargeError(path, total, LINES_LIMIT, hint)
            yield number, line


def _read_text(path: str | Path, hint: str) -> str:
    try:
        return read_regular_text(path, hint=hint)
    except UnicodeDecodeError as err:
        raise DamagedFileError(path, _reason(err), hint) from None


def _parsed_lines(path: str | Path, hint: str, complete_only: bool = False) -> Iterator[tuple[int, bytes, Any]]:
    """``(line number, line, its value)`` of each non-blank line of ``path`` (:func:`json_lines`);
    :class:`DamagedFileError` naming the first that is not UTF-8 JSON. ``complete_only``: a last
    line without its newline is passed over."""
    offset = 0
    for number, line in json_lines(path, hint):
        start, offset = offset, offset + len(line)
        if complete_only and not line.endswith(b"\n"):
            return
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DamagedFileError(path, _reason(err, start), hint) from None
        if not text.strip():
            continue
        try:
            record = parse_json(text)
        except json.JSONDecodeError as err:
            raise DamagedFileError(path, f"line {number} is not valid JSON: {err.msg}", hint) from None
        yield number, line, record
