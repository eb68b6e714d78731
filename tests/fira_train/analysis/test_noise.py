"""Noise: the same runs with and without gradient noise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fira_train.analysis.noise import run_noise
from fira_train.run.metrics import read_metrics
from tests.fira_train.analysis.analysis_fixtures import analysis_config, corpus_root  # noqa: F401


def test_noise_end_to_end(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=3")
    out = tmp_path / "noise"
    result = run_noise(config, out, scale=1e-3)
    table = result["table"]
    assert set(table) == {"fira-only-scaling", "adamw"}
    for method, (clean, noisy) in table.items():
        assert clean != noisy
        # noise enters at the first update, not before: the first loss is the same
        assert read_metrics(out / method)[0]["loss"] == read_metrics(out / f"{method}-noise")[0]["loss"]
    spec = json.loads((out / "adamw-noise" / "analysis_run.json").read_text())
    assert spec["callbacks"] == "NormRecorder, GradientNoise(scale=0.001, seed=0, noise seed derived)"
    assert "noise / gradient = " in result["report"].read_text()
    text = result["report"].read_text()
    assert "445.5" in text and "| adamw |" in text
    assert "rank 16 for the low-rank methods" in text  # micro's rank: the report says what ran
    assert "(its seed derived from the run's, 0)" in text
    assert "| paper: with noise 1e-05 |" in text and "| measured: with noise 0.001 |" in text
    assert "The paper's columns are at its noise 1e-05, these runs at 0.001" in text
    assert result["figure"].read_bytes()[:4] == b"\x89PNG"


def test_noise_scale_is_checked_before_training(tmp_path: Path, corpus_root: Path) -> None:
    with pytest.raises(ValueError, match="scale"):
        run_noise(analysis_config(corpus_root, tmp_path / "run"), tmp_path / "x", scale=-1.0)
    assert not (tmp_path / "x").exists()
