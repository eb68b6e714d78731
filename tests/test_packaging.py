"""What ``pip install fira-optim`` and ``pip install "fira-optim[train]"`` give, not what an editable
install of this checkout gives: the harness's imports are declared in the ``train`` extra, and the
command line installed without that extra says what to install instead of a traceback."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
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
