"""Which files in a run directory fira-train wrote, and refusing to write over the others.

A run directory (``--out``) holds what :func:`fira_train.run.train.train` writes (``config.json``,
``metrics.jsonl``, ``summary.json``, ``tb/``, ``checkpoints/``, the lock file) and what the
analyses' recorders add next to it. Anything else is *foreign*: a model's ``config.json``
from Hugging Face, a user's notes, another tool's output. A ``config.json`` counts as
fira-train's only if it reads as a run config (a JSON object of ``recipe`` and the ``model`` /
``optim`` / ``data`` / ``train`` sections); in ``checkpoints/`` only the checkpoint folders, in
``tb/`` only TensorBoard's event files: what else is there is foreign too.

:func:`check_foreign_files` is called before a run touches its directory:

- a new run (no ``--resume``) into a directory with foreign files is refused unless
  ``--overwrite``; with it, fira-train's own files are replaced (a foreign ``config.json``
  too: the run's config must go there) and the other foreign files are left alone;
- ``--resume`` needs a fira-train run there (or an empty directory): it tolerates foreign files
  next to a run of its own (they are never written), but refuses a foreign ``config.json``
  and a directory holding foreign files and no run.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from fira_train.files import ANALYSIS_RUN_FILE, parse_json, read_regular_text
from fira_train.run.checkpoint import CHECKPOINT_DIR
from fira_train.run.run_lock import LOCK_FILE

log = logging.getLogger(__name__)

#: Files :func:`fira_train.run.train.train` writes (``config.json`` is checked by content).
RUN_FILES = frozenset({"config.json", "metrics.jsonl", "metrics.jsonl.tmp", "summary.json", LOCK_FILE,
                       # a write interrupted by a crash (fira_train.files.write_text_atomic)
                       "config.json.tmp", "summary.json.tmp"})
RUN_DIRS = frozenset({"tb", CHECKPOINT_DIR})
#: Files the analyses write into their runs' folders (the run spec, :data:`~fira_train.files.ANALYSIS_RUN_FILE`,
#: :data:`~fira_train.analysis.callbacks.NORMS_FILE`, :data:`~fira_train.analysis.similarity.FACTORS_FILE`).
ANALYSIS_FILES = frozenset({ANALYSIS_RUN_FILE, "norms.jsonl", "scaling_factors.jsonl"})
#: Every name a run (an analysis's included) writes in its folder: what must hold no link.
WRITTEN = RUN_FILES | RUN_DIRS | ANALYSIS_FILES
#: What a run writes under ``checkpoints/``: complete, temporary and replaced checkpoints.
_CHECKPOINT_ENTRY = re.compile(r"^(\.tmp-|\.old-)?step_\d{8,}(-\d+)?$")
_CONFIG_KEYS = frozenset({"recipe", "model", "optim", "data", "train"})
_SHOWN = 5


def is_run_config(path: Path) -> bool:
    """Whether ``path`` (a ``config.json``) reads as a fira-train run config."""
    try:
        values = parse_json(read_regular_text(path))
    except (OSError, ValueError):
        return False
    return (isinstance(values, dict) and set(values) <= _CONFIG_KEYS
            and all(isinstance(values.get(s), dict) for s in ("optim", "train")))


def _damaged_run_config(path: Path) -> bool:
    """A ``config.json`` that is not JSON at all, beside a run's metrics or checkpoints: the
    run's own config, damaged (reading it then says so and names it), not a foreign file."""
    try:
        parse_json(read_regular_text(path))
        return False
    except (OSError, ValueError):
        out = path.parent
        return (out / "metrics.jsonl").is_file() or holds_checkpoints(out)


def foreign_files(out: str | Path) -> list[str]:
    """Entries of ``out`` that fira-train did not write (names relative to ``out``, folders
    with a trailing ``/``), sorted; [] for a missing directory."""
    out = Path(out)
    if not out.is_dir():
        return []
    foreign = []
    for child in sorted(out.iterdir()):
        name = child.name
        if not child.is_symlink() and not child.exists():
            # listed, then deleted: under a launch, rank 0 deletes the previous run (--overwrite)
            # while the other ranks look, and a run's metrics.jsonl read as a foreign file
            continue
        if child.is_dir() and not child.is_symlink() and name in RUN_DIRS:
            try:
                entries = sorted(child.iterdir())
            except FileNotFoundError:  # deleted (rank 0's --overwrite) after it was looked at
                continue
            foreign += [f"{name}/{c.name}" for c in entries if not RUN_DIR_ENTRIES[name](c)]
            continue
        if child.is_file() and not child.is_symlink():
            if name == "config.json" and (is_run_config(child) or _damaged_run_config(child)):
                continue
            if name in (RUN_FILES | ANALYSIS_FILES) - {"config.json"}:
                continue
        foreign.append(name + ("/" if child.is_dir() else ""))
    return foreign


def is_checkpoint_entry(path: Path) -> bool:
    """Whether ``path`` (an entry of ``OUT/checkpoints``) is a folder a run writes there: a
    complete, temporary or replaced checkpoint (not a link to one)."""
    return bool(_CHECKPOINT_ENTRY.match(path.name)) and path.is_dir() and not path.is_symlink()


def is_event_file(path: Path) -> bool:
    """Whether ``path`` (an entry of ``OUT/tb``) is a file the run's TensorBoard writer makes
    there (``events.out.tfevents.*``; not a link to one)."""
    return path.name.startswith("events.out.tfevents.") and path.is_file() and not path.is_symlink()


#: The folders a run writes in ``OUT`` (:data:`RUN_DIRS`), and which of their entries are the
#: run's: what ``--overwrite`` deletes there, and what else is foreign.
RUN_DIR_ENTRIES: dict[str, Callable[[Path], bool]] = {CHECKPOINT_DIR: is_checkpoint_entry, "tb": is_event_file}


def remove_run_entries(folder: Path, ours: Callable[[Path], bool]) -> None:
    """Delete what a run wrote in ``folder``: the entries ``ours`` says are its own
    (:data:`RUN_DIR_ENTRIES`; fine-tuning's ``OUT/trainer``), and the folder itself if nothing
    else is left in it. Another tool's files there (``--out .`` in a project with a checkpoints/,
    tb/ or trainer/ of its own) stay: the whole folder was deleted with them."""
    if not folder.is_dir() or folder.is_symlink():
        return
    for child in sorted(folder.iterdir()):
        if ours(child):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    try:
        folder.rmdir()
    except OSError:  # another tool's files, left as they are
        pass


def previous_run(out: Path) -> list[str]:
    """The files of a run that ``out`` already holds (none: it holds no run's records).
    ``checkpoints/`` counts only with a checkpoint folder of a run's in it
    (:func:`holds_checkpoints`): another tool's checkpoints/ alone is no run to resume."""
    found = [name for name in ("metrics.jsonl", "summary.json") if (out / name).exists()]
    return found + ([CHECKPOINT_DIR] if holds_checkpoints(out) else [])


def holds_checkpoints(out: Path) -> bool:
    """Whether ``out/checkpoints`` holds a folder a run wrote there (:func:`is_checkpoint_entry`:
    complete, temporary or replaced), not only another tool's files."""
    folder = out / CHECKPOINT_DIR
    if not folder.is_dir() or folder.is_symlink():
        return False
    try:
        return any(is_checkpoint_entry(child) for child in folder.iterdir())
    except FileNotFoundError:  # deleted (rank 0's --overwrite) while another rank looks
        return False


def _has_run(out: Path) -> bool:
    return bool(previous_run(out)) or ((out / "config.json").is_file() and is_run_config(out / "config.json"))


def _folders_with_runs(out: Path, depth: int = 3) -> list[str]:
    """The folders of ``out`` that hold a run within ``depth`` levels: compare's and the
    analyses' ``OUT/<run>``, the sweep's ``OUT/<method>/<lr>/<seed>``, memory's ``OUT/runs/<method>``."""
    def holds(folder: Path, levels: int) -> bool:
        if _has_run(folder):
            return True
        return levels > 1 and any(holds(child, levels - 1) for child in sorted(folder.iterdir())
                                  if child.is_dir() and not child.is_symlink())

    return [child.name for child in sorted(out.iterdir())
            if child.is_dir() and not child.is_symlink() and holds(child, depth)]


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_foreign_files(out: str | Path, resume: str | int | None, overwrite: bool, *,
                        warn: bool = True) -> None:
    """FileExistsError if the run may not write into ``out`` (see the module docstring);
    ``warn``: log the foreign files that ``overwrite`` lets the run write beside."""
    out = Path(out)
    foreign = foreign_files(out)
    if not foreign:
        return
    if resume is None and overwrite:
        if warn:
            log.warning("--overwrite: %s holds files that fira-train did not write (%s): those of a "
                        "run are replaced, the others left as they are", out, _listing(foreign))
        return
    if resume is not None and _has_run(out) and "config.json" not in foreign:
        return  # a run of ours with other files beside it: resuming writes none of them
    inner = [name for name in _folders_with_runs(out) if f"{name}/" in foreign]
    if inner:  # compare's, sweep's, memory's, an analysis's folder, or one holding several runs
        raise FileExistsError(f"{str(out)!r} holds runs in folders of their own ({_listing(inner)}), as "
                              "compare, sweep, memory --measure and analyze write them: a run's --out is "
                              "the folder of that one run (--resume continues one of them); choose an "
                              "empty or new --out for a new run")
    advice = ("choose an empty or new --out, or start a new run there with --overwrite (it replaces "
              "fira-train's own files, config.json included, and leaves the others)")
    raise FileExistsError(f"{str(out)!r} holds files that fira-train did not write ({_listing(foreign)}); "
                          f"{advice}")
