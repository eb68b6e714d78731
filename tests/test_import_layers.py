"""The import contracts of pyproject.toml ([tool.importlinter]) hold: fira_train's subpackages are
layers with the command line on top, and fira_optim imports neither fira_train nor the harness's
dependencies. ``lint-imports`` checks the same contracts from the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    # In a process of its own: import-linter configures logging with dictConfig, which disables
    # every logger that exists by then, and the tests after it in this process would see no log.
    check = ("from importlinter.cli import lint_imports; "
             f"raise SystemExit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True, "
             "no_logo=True))")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
