"""The code a run records (``"code"`` in summary.json, checkpoints, results.json): the source
digest, the git checkout, and how a difference is worded."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import fira_optim
import fira_train
from fira_train import provenance
from fira_train.provenance import code_version, describe, describe_change, git_checkout, source_of, source_digest
from fira_train.report.markdown import code_line


def _tree(root: Path) -> dict[str, Path]:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("x = 1\n")
    (root / "pkg" / "sub" / "mod.py").write_text("y = 2\n")
    return {"pkg": root / "pkg"}


def test_the_source_digest_follows_the_python_files_and_nothing_else(tmp_path: Path) -> None:
    roots = _tree(tmp_path)
    first = source_digest(roots)
    assert len(first) == 16 and source_digest(roots) == first
    (roots["pkg"] / "README.md").write_text("docs change nothing\n")
    (roots["pkg"] / "data.json").write_text("{}")
    assert source_digest(roots) == first
    (roots["pkg"] / "sub" / "mod.py").write_text("y = 3\n")
    assert source_digest(roots) != first
    (roots["pkg"] / "sub" / "mod.py").write_text("y = 2\n")
    assert source_digest(roots) == first
    (roots["pkg"] / "sub" / "mod.py").rename(roots["pkg"] / "mod.py")  # the same bytes, moved
    assert source_digest(roots) != first


def test_this_process_records_its_version_and_installed_sources() -> None:
    code = code_version()
    assert set(code) == {"fira_optim", "source", "commit", "modified"}
    assert code["fira_optim"] == fira_optim.__version__
    assert code["source"] == source_digest({"fira_optim": Path(fira_optim.__file__).parent,
                                            "fira_train": Path(fira_train.__file__).parent})
    assert (code["commit"] is None) == (code["modified"] is None)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_is_the_checkout_the_package_lies_in_as_src_package(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    package = tmp_path / "src" / "fira_train"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    git("init", "-q")
    assert git_checkout(package) == (None, None)  # no commit yet
    git("add", "-A")
    git("commit", "-q", "-m", "first")
    head = git("rev-parse", "HEAD")
    assert git_checkout(package) == (head, False)
    (package / "new.py").write_text("")  # a new module: what runs has changed
    assert git_checkout(package) == (head, True)
    (package / "new.py").unlink()
    (tmp_path / "README.md").write_text("outside src/")
    assert git_checkout(package) == (head, False)
    (package / "__init__.py").write_text("changed = True\n")
    assert git_checkout(package) == (head, True)
    # a package that is not <top>/src/<name> of its repository (a virtual environment inside a
    # project): that repository's commit would name other code
    other = tmp_path / "venv" / "fira_train"
    other.mkdir(parents=True)
    assert git_checkout(other) == (None, None)


def test_a_missing_git_gives_no_commit(tmp_path: Path, monkeypatch) -> None:
    def missing(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance.subprocess, "run", missing)
    assert git_checkout(Path(fira_train.__file__).parent) == (None, None)


def test_differences_are_worded_with_both_versions() -> None:
    now = code_version()
    assert describe_change(now) is None
    assert describe_change({**now, "commit": "0" * 40}) is None  # the same sources: the same code
    other = {"fira_optim": "0.0.9", "source": "feedfacefeedface", "commit": "a" * 40, "modified": True}
    assert describe(other) == "source feedfacefeedface (git aaaaaaaaaa, modified)"
    assert describe_change(other) == f"source feedfacefeedface (git aaaaaaaaaa, modified) against this code's {describe(now)}"
    assert describe_change(None).startswith("not recorded against this code's source ")
    assert describe({"source": "feedfacefeedface", "commit": None}) == "source feedfacefeedface"
    assert source_of({"code": other}) == "feedfacefeedface"
    assert source_of({"code": "junk"}) is None and source_of(None) is None and source_of({}) is None


def test_a_report_names_the_code_of_its_runs() -> None:
    assert code_line([]) == "Code: no run yet."
    assert code_line(["a1", "a1"]) == "Code: every run (2) was made by source `a1`."
    assert code_line([None]) == "Code: no run (1) recorded the code that made it (made before runs recorded it)."
    mixed = code_line(["b2", None, "a1", "a1"])
    assert mixed.startswith("Code: the runs were made by 3 versions of the code (runs of each: source `a1` 2, "
                            "source `b2` 1, not recorded 1); a fix made between them")


def test_the_version_is_read_when_a_run_starts_not_when_it_is_recorded(tmp_path: Path, monkeypatch) -> None:
    """A checkout edited (or committed) while a run trains: the record names the code loaded."""
    from fira_train.run import train as train_module
    from tests.fira_train.harness_fixtures import micro_config

    calls = []
    monkeypatch.setattr(train_module, "code_version", lambda: calls.append("read") or {"source": "x"})
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", "train.eval_every=0")
    monkeypatch.setattr(train_module, "_train", lambda *args: calls.append("trained") or {})
    train_module.train(config)
    assert calls == ["read", "trained"]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_asking_git_does_not_touch_the_user_s_index(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    package = tmp_path / "src" / "fira_train"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "first")
    index = tmp_path / ".git" / "index"
    before = index.stat().st_mtime_ns
    import os
    import time
    time.sleep(0.05)
    os.utime(package / "__init__.py")  # stat data changed: a status with optional locks rewrites the index
    assert git_checkout(package)[1] is False
    assert index.stat().st_mtime_ns == before
