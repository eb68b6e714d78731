"""Which code made a run: recorded in its ``summary.json`` (``"code"``), its checkpoints and a
fine-tuning run's ``results.json``, so that a result can be traced to the code that produced it.

:func:`code_version` is ``{"fira_optim", "source", "commit", "modified"}``:

- ``fira_optim``: the package version (``fira_optim.__version__``);
- ``source``: the first 16 hex digits of a SHA-256 over the Python sources of ``fira_optim``
  and ``fira_train`` as they are installed (each file's path relative to its package, then its
  bytes, in path order). It names what runs, with or without git: a change to the docs, tests
  or benchmarks leaves it alone, a change to either package changes it;
- ``commit``: the git commit of the checkout the packages are imported from (an editable
  install), else None (a wheel, no git, or the packages imported from another repository);
- ``modified``: whether that checkout's files under ``src/`` differ from the commit (a tracked
  file changed, or a file git does not ignore added; None without a commit).

Two runs whose ``source`` differ may still give the same numbers (a refactor), and a run is
reused or resumed regardless (the config and the data decide that); :func:`describe_change`
words the difference for the warning either prints.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

def source_digest(roots: Mapping[str, Path]) -> str:
    """16 hex digits of the SHA-256 over every ``*.py`` below each root (``name -> folder``):
    ``name/relative/path``, a NUL, the file's bytes, a NUL, in order of that path."""
    files = sorted((f"{name}/{path.relative_to(root).as_posix()}", path)
                   for name, root in roots.items() for path in root.rglob("*.py"))
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _git(cwd: Path, *args: str) -> str | None:
    """``git args`` in ``cwd``: its output stripped, None if git is missing, fails or hangs.
    Without optional locks: ``git status`` would otherwise refresh the user's index (taking
    ``index.lock``) from every process that asks, racing their own ``git add``."""
    try:
        done = subprocess.run(["git", "--no-optional-locks", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_checkout(package_root: Path) -> tuple[str | None, bool | None]:
    """(commit, modified) of the git checkout ``package_root`` (a package's folder) belongs to as
    ``src/<package>``; (None, None) if it is not one (then the packages may sit in some other
    repository, such as a virtual environment inside a project: its commit would name the wrong code)."""
    top = _git(package_root, "rev-parse", "--show-toplevel")
    if top is None or Path(top, "src", package_root.name).resolve() != package_root.resolve():
        return None, None
    commit = _git(package_root, "rev-parse", "HEAD")
    if commit is None:  # a repository without commits
        return None, None
    # untracked files count: a new module under src/ changes what runs (ignored ones, such as
    # __pycache__, are not listed)
    status = _git(package_root, "status", "--porcelain", "--", str(Path(top, "src")))
    return commit, None if status is None else bool(status)


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """This process's code (see the module's docstring); computed once per process, from the
    files on disk at the first call: :func:`fira_train.run.train.train` and the fine-tuning run
    call it as they start, so that an edit of the checkout while a run trains is not recorded
    as the code that ran."""
    import fira_optim

    roots = {"fira_optim": Path(fira_optim.__file__).parent, "fira_train": Path(__file__).parent}
    commit, modified = git_checkout(roots["fira_train"])
    return {"fira_optim": fira_optim.__version__, "source": source_digest(roots), "commit": commit,
            "modified": modified}


def source_of(record: Any) -> str | None:
    """The ``source`` digest that a run's record (``summary.json``, a divergence marker) holds
    under ``"code"``; None if it holds none."""
    code = record.get("code") if isinstance(record, Mapping) else None
    return code.get("source") if isinstance(code, Mapping) else None


def describe(code: Any) -> str:
    """A recorded code version in words: ``source 0123abcd... (commit 4567cdef, modified)``."""
    if not isinstance(code, Mapping):
        return "not recorded"
    text = f"source {code.get('source')}"
    if code.get("commit"):
        text += f" (git {str(code['commit'])[:10]}{', modified' if code.get('modified') else ''})"
    return text


def describe_change(recorded: Any) -> str | None:
    """None if ``recorded`` (a run's ``"code"`` record; None for a run made before the record)
    names this process's sources; else both, in words: ``source A (git ...) against this code's
    source B (git ...)``."""
    now = code_version()
    if isinstance(recorded, Mapping) and recorded.get("source") == now["source"]:
        return None
    return f"{describe(recorded)} against this code's {describe(now)}"
