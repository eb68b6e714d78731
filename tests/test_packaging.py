"""What ``pip install fira-optim`` and ``pip install "fira-optim[train]"`` give, not what an editable
install of this checkout gives: the wheel and sdist hold the packages' files and nothing else, the
harness's imports are declared in the ``train`` extra, and the command line installed without that
extra says what to install instead of a traceback.

The archives are built by setuptools' own backend (no ``build`` package, no isolated environment)
from a copy of the project's files, so that the checkout's egg-info is left alone; skipped where the
installed setuptools is older than the one pyproject.toml asks for."""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from fira_train.user_errors import TRAIN_EXTRA_MODULES, describe

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _requirement_name(requirement: str) -> str:
    """The normalised distribution name of a requirement (PEP 503): ``flora-opt[torch]==0.0.3`` -> ``flora-opt``."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _version() -> str:
    tree = ast.parse((SRC / "fira_optim" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("fira_optim/__init__.py sets no __version__")


def _package_files() -> set[str]:
    """Every file of the two packages in this checkout (modules and data files), relative to src/."""
    return {str(path.relative_to(SRC)) for package in ("fira_optim", "fira_train")
            for path in (SRC / package).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo")}


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel, built from a copy of the project's top-level files, src/ and tests/."""
    wanted = next(r for r in _pyproject()["build-system"]["requires"] if _requirement_name(r) == "setuptools")
    minimum = re.search(r">=\s*([\d.]+)", wanted)
    try:
        have = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:  # a venv of Python 3.12+ has none
        pytest.skip("setuptools is not installed")
    as_tuple = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:3])  # noqa: E731
    if minimum and as_tuple(have) < as_tuple(minimum.group(1)):
        pytest.skip(f"setuptools {have} is older than the build's {wanted}")
    root = tmp_path_factory.mktemp("packaging")
    project, dist = root / "project", root / "dist"
    junk = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.egg-info", "build")
    project.mkdir()
    for path in ROOT.iterdir():
        if path.is_file() and path.name != ".git":  # a worktree's link to its repository: no git in the copy
            shutil.copy2(path, project / path.name)
    for folder in ("src", "tests"):
        shutil.copytree(ROOT / folder, project / folder, ignore=junk)
    for hook in ("build_sdist", "build_wheel"):  # one process per hook, as build frontends call them
        code = f"import sys; from setuptools import build_meta; build_meta.{hook}(sys.argv[1])"
        proc = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=project, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_the_wheel_holds_every_file_of_the_packages_and_nothing_else(archives: dict[str, Path]) -> None:
    with zipfile.ZipFile(archives["wheel"]) as wheel:
        names = wheel.namelist()
        info = f"fira_optim-{_version()}.dist-info"
        assert archives["wheel"].name == f"fira_optim-{_version()}-py3-none-any.whl"
        assert {n for n in names if not n.startswith(info + "/")} == _package_files()
        assert "fira_optim/py.typed" in names  # PEP 561: type checkers read the library's annotations
        metadata = email.parser.Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
        licence = wheel.read(f"{info}/licenses/LICENSE").decode()
    assert metadata["Name"] == "fira-optim" and metadata["Version"] == _version()
    assert [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r] == ["torch>=2.6"]
    assert set(metadata.get_all("Provides-Extra")) >= {"train", "hf", "lowbit"}
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata["License-Expression"] == "Apache-2.0" and metadata.get_all("License-File") == ["LICENSE"]
    assert "Apache License" in licence and "Version 2.0" in licence
    assert metadata.get_payload().startswith("# fira-optim")  # README.md
    assert re.search(r"^fira-train = fira_train\.cli:main$", entry_points, re.M), entry_points


def test_the_sdist_holds_what_builds_the_wheel_and_no_partial_test_suite(archives: dict[str, Path]) -> None:
    top = f"fira_optim-{_version()}/"
    with tarfile.open(archives["sdist"]) as sdist:
        names = {n[len(top):] for n in sdist.getnames() if n.startswith(top)}
    assert {"pyproject.toml", "README.md", "PKG-INFO", "MANIFEST.in", "LICENSE"} <= names
    assert {f"src/{name}" for name in _package_files()} <= names
    shipped = {n.split("/")[0] for n in names if n}
    assert shipped <= {"src", "pyproject.toml", "README.md", "PKG-INFO", "MANIFEST.in", "setup.cfg", "LICENSE"}, shipped


def _third_party_imports(package: Path) -> dict[str, set[str]]:
    """Top-level module -> files of ``package`` that import it, for every module neither of the
    standard library nor of this project (relative imports are the project's)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("fira_optim", "fira_train"):
                    found.setdefault(top, set()).add(str(path.relative_to(SRC)))
    return found


def test_the_harness_imports_only_what_the_train_extra_declares() -> None:
    """Every third-party import of fira_train is torch (the library's dependency) or a module of
    TRAIN_EXTRA_MODULES, and each of those is a requirement of the ``train`` extra: an import of a
    package that only the dev environment happens to hold works here and fails after
    ``pip install "fira-optim[train]"``."""
    project = _pyproject()["project"]
    base = {_requirement_name(r) for r in project["dependencies"]}
    train = {_requirement_name(r) for r in project["optional-dependencies"]["train"]}
    assert base == {"torch"}
    imports = _third_party_imports(SRC / "fira_train")
    undeclared = {m: sorted(files) for m, files in imports.items() if m != "torch" and m not in TRAIN_EXTRA_MODULES}
    assert not undeclared, f"imported by fira_train but not in TRAIN_EXTRA_MODULES: {undeclared}"
    # a module's distribution is its name with '-' for '_' for every package the harness uses
    assert {m.replace("_", "-") for m in TRAIN_EXTRA_MODULES} <= train
    library = set(_third_party_imports(SRC / "fira_optim"))
    # torch; transformers for fira_optim.integrations (the hf extra); torchao for int8 states (lowbit)
    assert library <= {"torch", "transformers", "torchao"}, library


def test_a_missing_package_of_the_extra_is_one_line_naming_the_extra() -> None:
    message = describe(ModuleNotFoundError("No module named 'transformers'", name="transformers"))
    assert message is not None and "pip install 'fira-optim[train]'" in message and "'transformers'" in message
    assert 'pip install -e ".[train]" in a checkout' in message  # what a source checkout runs
    assert describe(ModuleNotFoundError("No module named 'scipy.stats'", name="scipy.stats")) is not None
    # a module that is not the extra's (fira_train's own, a typo) is a bug: its traceback
    assert describe(ModuleNotFoundError("No module named 'fira_train.nope'", name="fira_train.nope")) is None


@pytest.mark.parametrize("argv", [["--help"], ["methods"], ["pretrain", "--recipe", "micro", "--method", "fira"]])
def test_fira_train_without_the_train_extra_says_what_to_install(argv: list[str]) -> None:
    """``pip install fira-optim`` installs the command too: run without the extra's packages (each
    import of one fails as if it were not installed), it names the extra, with no traceback."""
    code = ("import sys\n"
            "from fira_train.user_errors import TRAIN_EXTRA_MODULES\n"
            "for name in TRAIN_EXTRA_MODULES:\n"
            "    sys.modules[name] = None  # `import name` raises ModuleNotFoundError\n"
            "from fira_train.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("FIRA_TRACEBACK", None)
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("fira-train: error: the package ") and "pip install 'fira-optim[train]'" in proc.stderr
