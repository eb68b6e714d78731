"""Ablation: the variants, the stabilisers and the gamma runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fira_train.analysis.ablation import (
    DEFAULT_GAMMAS,
    DEFAULT_VARIANTS,
    ablation_runs,
    gamma_run_name,
    run_ablation,
)
from fira_train.analysis.runs import RUN_SPEC_FILE
from tests.fira_train.analysis.analysis_fixtures import analysis_config, corpus_root  # noqa: F401


def test_gamma_runs_reuse_the_variants_they_equal() -> None:
    assert gamma_run_name(math.inf) == "fira-no-limiter" and gamma_run_name(1.01) == "fira"
    assert gamma_run_name(1.1) == "fira-gamma1.1" and gamma_run_name(1.0) == "fira-gamma1"
    runs = ablation_runs(["fira", "fira-no-limiter"], [math.inf, 1.1, 1.01, 1.0])
    assert [r.name for r in runs] == ["fira", "fira-no-limiter", "fira-gamma1.1", "fira-gamma1"]
    assert runs[2].method == "fira" and runs[2].describe == "GroupOptions(gamma=1.1)"
    # gammas that 6 significant digits would round together: two runs, each at its own gamma
    close = ablation_runs(["fira"], [1.0, 1.0000001])
    assert [(r.name, r.describe) for r in close[1:]] == [("fira-gamma1", "GroupOptions(gamma=1.0)"),
                                                        ("fira-gamma1.0000001", "GroupOptions(gamma=1.0000001)")]


def test_default_runs_cover_the_three_tables() -> None:
    names = [r.name for r in ablation_runs(DEFAULT_VARIANTS, DEFAULT_GAMMAS)]
    assert names == ["fira", "fira-no-scaling", "fira-matrix", "fira-no-limiter", "fira-clip", "fira-shrink",
                     "fira-tensorwise", "fira-gamma1.1", "fira-gamma1.001", "fira-gamma1"]


def test_ablation_end_to_end(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=3")
    out = tmp_path / "ablation"
    # a subset keeps the test fast; the default lists are checked in test_default_runs
    result = run_ablation(config, out, variants=("fira", "fira-no-scaling", "fira-no-limiter", "fira-shrink"),
                          gammas=(math.inf, 1.1, 1.01, 1.0))
    ppl = result["ppl"]
    assert set(ppl) == {"fira", "fira-no-scaling", "fira-no-limiter", "fira-shrink", "fira-gamma1.1", "fira-gamma1"}
    assert all(math.isfinite(v) and v > 1 for v in ppl.values())
    assert len({round(v, 9) for v in ppl.values()}) == 6
    assert json.loads((out / "fira-gamma1" / RUN_SPEC_FILE).read_text())["callbacks"] == "GroupOptions(gamma=1.0)"
    # gamma = 1 forbids any growth of ||S_t||: the run differs from gamma = 1.1
    assert ppl["fira-gamma1"] != ppl["fira-gamma1.1"]
    text = result["report"].read_text()
    spread = 100 * (max(ppl.values()) / min(ppl.values()) - 1)
    assert f"Spread of all measured perplexities: {spread:.1f}%" in text
    for label in ("Fira-w.o.-scaling", "Fira-gradient-shrink", "inf (no limiter)", "37.06", "Sensitivity to gamma",
                  "| paper | 31.06 | 33.98 | 32.22 |"):
        assert label in text
    assert result["figure"].read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("gamma", [0.9, math.nan, "1.1"])
def test_ablation_rejects_bad_gammas(tmp_path: Path, corpus_root: Path, gamma) -> None:
    with pytest.raises(ValueError, match="gammas"):
        run_ablation(analysis_config(corpus_root, tmp_path / "run"), tmp_path / "x", variants=(), gammas=(gamma,))


def test_ablation_refuses_a_gamma_of_its_own(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "optim.gamma=1.1")
    with pytest.raises(ValueError, match="optim.gamma=1.1: the ablation compares limiter settings itself"):
        run_ablation(config, tmp_path / "x", variants=("fira",), gammas=(1.5,))
    assert not (tmp_path / "x").exists()
