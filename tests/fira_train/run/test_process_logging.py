"""A fira-train process's stderr: no third-party notices at import about parts no command uses."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
NOISE = ("Failed to load", "Detected no triton", "register_constant")


def _stderr_of_importing_transformers_quantizers(setup: str) -> str:
    """What importing transformers' quantizers (which import torchao) prints after ``setup``."""
    code = f"import logging, sys\n{setup}\nimport transformers.quantizers.auto\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is what prints the notices")
def test_import_notices_are_kept_out_of_a_commands_stderr() -> None:
    plain = _stderr_of_importing_transformers_quantizers(
        "logging.basicConfig(level=logging.INFO, format='%(message)s', stream=sys.stderr)")
    ours = _stderr_of_importing_transformers_quantizers(
        "from fira_train.run.process_logging import configure_logging\nconfigure_logging(logging.INFO)")
    assert any(n in plain for n in NOISE)  # the notices exist where logging is merely configured
    assert not any(n in ours for n in NOISE), ours
