"""``fira-train finetune``'s command line: its errors are its own line, nothing before it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _python(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def test_an_error_is_not_preceded_by_bitsandbytes_import_noise(tmp_path: Path) -> None:
    """"Failed to load CPU gemm_4bit_forward from kernels-community ..." came first: bitsandbytes,
    imported by peft through transformers' Trainer, warns at import about 4-bit kernels finetune
    never uses."""
    noisy = _python(["-c", "import logging; logging.basicConfig(); import bitsandbytes"])
    if noisy.returncode != 0 or not noisy.stderr.strip():
        pytest.skip("bitsandbytes is not installed here, or says nothing at import")
    done = _python(["-m", "fira_train", "finetune", "--tasks", "boolq", "--data-dir", str(tmp_path / "none"),
                    "--out", str(tmp_path / "run")])
    assert done.returncode == 1
    assert done.stderr.startswith("fira-train finetune: error: data_dir=") and len(done.stderr.splitlines()) == 1, (
        done.stderr)


def test_a_warning_of_bitsandbytes_after_its_import_still_shows() -> None:
    """Only the import is quiet: the logger's level is back afterwards."""
    import logging

    from fira_train.methods.packages import quiet_import_logs

    logger = logging.getLogger("bitsandbytes")
    before = logger.level
    with quiet_import_logs():
        assert not logger.isEnabledFor(logging.WARNING)
    assert logger.level == before and logger.isEnabledFor(logging.WARNING)
