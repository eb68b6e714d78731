"""The import contracts of pyproject.toml ([tool.importlinter]) hold: fira_train's subpackages are
layers with the command line on top, and fira_optim imports neither fira_train nor the harness's
dependencies. ``lint-imports`` checks the same contracts from the command line."""

from __future__ import annotations

from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0
