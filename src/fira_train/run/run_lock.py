"""One run at a time per run directory: an ``fcntl.flock`` on ``OUT/.fira-train.lock``.

:func:`locked_run_directory` holds an exclusive lock on the lock file for as long as the run
lives (``train()`` wraps the whole run in it). A second run into the same ``--out`` (started
at the same time, or a ``--resume`` while the first one still trains) finds the lock taken and
stops at once with :class:`RunDirectoryBusy`, before it reads or writes anything in the
directory. The lock belongs to the open file, so the kernel releases it when the process exits,
however it exits (``kill -9`` included): a stale lock file never blocks a later run. The file
holds the holder's process id, for the message. A run stopped by an error before it wrote
anything beside the lock file removes the lock file and the folders the lock made for it (``OUT``
and its missing parents), so that a refused start leaves nothing for the next run to find; a
folder that was there before stays.

Under ``torchrun`` rank 0 takes the lock and tells the other ranks whether it got it, so that
every rank of a refused launch stops with the same error (and none waits forever for rank 0),
which rank 0 alone prints (:func:`fira_train.run.launch.same_on_every_rank`).
Several processes of one launch share the directory by design.

``flock`` works between processes on one machine; on network file systems it depends on the
server (NFSv4 maps it onto byte-range locks). Without ``fcntl`` (Windows) runs are not locked.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fira_train.files import RUN_LOCK_FILE, open_regular
from fira_train.run.launch import SAME_ON_EVERY_RANK

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from fira_train.run.parallel import DistributedEnv

log = logging.getLogger(__name__)

LOCK_FILE = RUN_LOCK_FILE


class RunDirectoryBusy(FileExistsError):
    """Another run holds the run directory. A ``FileExistsError`` (without an errno), like the
    refusal of a new run into a folder that already holds one: the command line reports both
    as one line."""


class _Removed(Exception):
    """The lock file (or its folder) was removed while this run took the lock."""


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``OUT/.fira-train.lock`` (created, with ``OUT``,
    if missing)."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.path = self.out / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; RunDirectoryBusy if another process (or another open of it) holds it."""
        if fcntl is None:
            return
        for attempt in range(3):
            try:
                self._acquire()
                return
            except _Removed:
                # a run that stopped before writing anything removed its lock file (and the folder
                # it made) between our open and our lock: take the lock of a file that is there
                if attempt == 2:
                    raise OSError(f"{str(self.path)!r} was removed three times as this run took the lock: "
                                  "another fira-train run keeps starting and stopping in that folder") from None

    def _acquire(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        # never through a link planted as the lock: it would truncate the file it names (a
        # symbolic link fails to open; a file with other hard links is refused before it is written)
        try:
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # nor into a FIFO or a device
        except FileNotFoundError:  # the folder removed since the mkdir
            raise _Removed from None
        if os.fstat(fd).st_nlink > 1:  # an OSError: under torchrun every rank raises it (locked_run_directory)
            os.close(fd)
            raise OSError(f"{str(self.path)!r} has other hard links: a run folder from elsewhere may name a file "
                          "outside it so; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode("ascii", "replace").strip()
            os.close(fd)
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise RunDirectoryBusy(
                f"run directory {str(self.out)!r} is in use by another fira-train run{who}; wait for "
                "it to finish, or pass another --out") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.path.samestat(os.stat(self.path), os.fstat(fd))
        except FileNotFoundError:
            same = False
        if not same:  # locked a file that is no longer the lock file
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise _Removed
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


@contextlib.contextmanager
def locked_run_directory(out: str | Path, env: DistributedEnv | None = None) -> Iterator[None]:
    """Hold the run directory ``out`` for the duration of the ``with`` block (see the module
    docstring); every rank of a ``torchrun`` launch must enter it."""
    distributed = env is not None and env.distributed
    lock = RunLock(out)
    error: BaseException | None = None
    made: list[Path] = []  # the folders acquire() makes: a run that writes nothing removes them again
    if not distributed or env.is_main:
        made = missing_folders(lock.out)
        try:
            lock.acquire()
        except (RunDirectoryBusy, OSError, ValueError) as err:  # ValueError: a lock that is not a file
            error = err
    if distributed:
        import torch.distributed as dist

        message: list[Any] = [None if error is None else _plain(error)]
        dist.broadcast_object_list(message, src=0, device=env.device)  # plain values, from rank 0
        if error is None and message[0] is not None:
            error = _rebuilt(*message[0])
    if distributed and error is not None:
        # rank 0's one decision, raised by every rank alike: the command line prints it on rank 0
        # alone (each process printed it)
        setattr(error, SAME_ON_EVERY_RANK, True)
    try:
        if error is not None:
            raise error
        yield
    except BaseException:
        if made and lock.held:  # stopped before writing anything: no new folder stays
            unlink_a_lone_lock(lock.out)
        lock.release()
        for folder in made:  # innermost first; one that holds anything stays, with those above it
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    finally:
        lock.release()  # (a second release does nothing)


def _plain(error: BaseException) -> tuple[str, int | None, str | None, str | None, str]:
    """Rank 0's refusal as plain values for the other ranks: its kind, and an ``OSError``'s errno,
    reason and file, so that each rank describes it as rank 0 does (one rebuilt from its text
    alone was "[Errno 20] Not a directory: 'OUT'" there, where rank 0 named the file in the way)."""
    if isinstance(error, OSError) and error.errno is not None:
        return type(error).__name__, error.errno, error.strerror, _text(error.filename), str(error)
    return type(error).__name__, None, None, None, str(error)


def _text(filename: Any) -> str | None:
    return None if filename is None else os.fsdecode(filename)


def _rebuilt(kind: str, errno: int | None, strerror: str | None, filename: str | None,
             text: str) -> BaseException:
    """The error :func:`_plain` describes (``OSError(errno, ...)`` is the errno's subclass)."""
    if errno is not None:
        return OSError(errno, strerror, filename)
    kinds = {RunDirectoryBusy.__name__: RunDirectoryBusy, ValueError.__name__: ValueError}
    return kinds.get(kind, OSError)(text)


def missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, innermost first."""
    missing = []
    while not os.path.lexists(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def unlink_a_lone_lock(folder: Path) -> None:
    """Remove ``folder``'s lock file if nothing else is there (a run that wrote nothing)."""
    # while the lock is held: a run that opens the file now finds it busy; one that starts after
    # the unlink makes a new lock file, and the folder then stays (it is not empty)
    try:
        if [entry.name for entry in folder.iterdir()] == [LOCK_FILE]:
            (folder / LOCK_FILE).unlink()
    except OSError:
        pass
