"""Rank sweep: one run per method and rank plus the AdamW line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fira_train.analysis.rank_sweep import rank_sweep_runs, run_rank_sweep
from fira_train.config.recipes import TUNED_LR
from tests.fira_train.analysis.analysis_fixtures import analysis_config, corpus_root  # noqa: F401


def test_rank_sweep_end_to_end(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=3")
    out = tmp_path / "ranks"
    result = run_rank_sweep(config, out, ranks=(16, 4), methods=("fira", "galore"))
    assert set(result["table"]) == {"fira", "galore"} and set(result["table"]["fira"]) == {4, 16}
    for name, rank in (("fira-r4", 4), ("galore-r16", 16)):
        saved = json.loads((out / name / "config.json").read_text())
        assert saved["optim"]["rank"] == rank
    assert result["table"]["galore"][4] != result["table"]["galore"][16]
    assert result["baseline"] == json.loads((out / "adamw" / "summary.json").read_text())["val_ppl"]
    text = result["report"].read_text()
    assert "| fira |" in text and "| galore |" in text and "r = 4" in text
    assert "fira below galore at" in text and "ranks in one seed" in text
    assert result["figure"].read_bytes()[:4] == b"\x89PNG"
    assert "Measured at d_model 64: each rank beside the paper's at the same r/d_model" in text
    # ranks 4 and 16 of 64 are the paper's 16 and 64 of 256 (it read 35.91 | 32.90: its ranks 4 and 16)
    assert "|  | r = 16 (here 4) | r = 64 (here 16) | Adam |" in text
    assert "| paper: fira-only-scaling | 32.90 | 31.93 |" in text
    assert "learning rate: each method's default (fira 0.01, galore 0.01, adamw 0.001)" in text  # micro: none tuned


def test_rank_sweep_at_ranks_the_paper_did_not_run_shows_the_paper_s_own(tmp_path: Path, corpus_root: Path,
                                                                         monkeypatch) -> None:
    """The paper's table had no rank column left (only Adam) when no rank was one of its."""
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=2")
    # a recipe whose sweep chose fira's rate: the report says so (it said "default, untuned")
    monkeypatch.setitem(TUNED_LR, config.recipe, {"fira": 0.02})
    text = run_rank_sweep(config, tmp_path / "ranks", ranks=(2, 8), methods=("fira",))["report"].read_text()
    assert "learning rate: each method's tuned rate for the recipe (a sweep's choice on validation), else its " \
           "default (fira 0.02, adamw 0.001)" in text
    assert "|  | r = 4 | r = 16 | r = 64 | r = 128 | r = 256 | Adam |" in text
    assert "None of the ranks run here (2, 8) is at an r/d_model of the paper's" in text


def test_rank_sweep_rejects_bad_ranks_and_rankless_methods(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run")
    with pytest.raises(ValueError, match="d_model=64"):
        run_rank_sweep(config, tmp_path / "x", ranks=(65,))
    with pytest.raises(ValueError, match=r"rank 64 \(--ranks\) is d_model, full rank, where 'fira', 'galore' would"):
        run_rank_sweep(config, tmp_path / "x", ranks=(64,))
    with pytest.raises(ValueError, match="'adamw' has no rank"):
        run_rank_sweep(config, tmp_path / "x", ranks=(4,), methods=("adamw",))
    assert [r.name for r in rank_sweep_runs(["fira"], [4, 8])] == ["adamw", "fira-r4", "fira-r8"]


def test_a_rank_sweep_of_one_rank_says_so_instead_of_comparing_it_with_itself(tmp_path: Path,
                                                                              corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=2")
    text = run_rank_sweep(config, tmp_path / "ranks", ranks=(4,), methods=("fira",))["report"].read_text()
    assert "at r = 4 (one rank: no trend); gap to adamw at r = 4:" in text
    assert " vs " not in text.split("Measured:")[1].split("![")[0]  # it read "318.22 at r = 4 vs 318.22 at r = 4 (+0.0%)"


def test_fira_only_scaling_runs_at_full_rank_the_paper_s_last_column(tmp_path: Path, corpus_root: Path) -> None:
    """The paper's rank table ends with Fira-only-scaling at r = d_model (not Adam: its own column
    beside Adam's). The sweep refused r = d_model; the optimizer trained such matrices with Adam."""
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=2")
    result = run_rank_sweep(config, tmp_path / "ranks", ranks=(4, 64), methods=("fira-only-scaling",))
    full = json.loads((tmp_path / "ranks" / "fira-only-scaling-r64" / "summary.json").read_text())["val_ppl"]
    assert result["table"]["fira-only-scaling"][64] == full
    import torch

    saved = torch.load(tmp_path / "ranks" / "fira-only-scaling-r64" / "checkpoints" / "step_00000002" / "state.pt",
                       weights_only=True)["optimizer"]["state"]
    bases = [tuple(state["basis"].shape) for state in saved.values() if "basis" in state]
    assert bases and set(bases) == {(64, 64)}  # every matrix projected on all 64 directions, none Adam
    # full rank stands beside the paper's full-rank column (30.84), not its rank 64 of 256 (31.93)
    text = result["report"].read_text()
    assert "|  | r = 16 (here 4) | r = 256 (here 64) | Adam |" in text
    assert "| paper: fira-only-scaling | 32.90 | 30.84 | 34.06 |" in text


def test_the_rank_axis_labels_only_the_ranks_run(tmp_path: Path, monkeypatch) -> None:
    """Ranks 4 and 16 (micro's r/d_model 16/256 and 64/256) span under a decade and a half: a
    log minor tick between them was labelled "6 x 10^0", as if rank 6 had been run."""
    import matplotlib.pyplot as plt

    from fira_train.analysis.rank_sweep import _plot

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    _plot({"fira": {4: 195.0, 16: 198.0}}, 364.0, [4, 16], tmp_path / "ranks.png")
    figure = figures[0]
    figure.canvas.draw()
    (ax,) = figure.axes
    low, high = ax.get_xlim()
    labels = [(tick.get_loc(), tick.label1.get_text()) for tick in (*ax.xaxis.get_major_ticks(),
                                                                      *ax.xaxis.get_minor_ticks())
              if low <= tick.get_loc() <= high and tick.label1.get_visible() and tick.label1.get_text()]
    assert sorted(labels) == [(4, "4"), (16, "16")], labels
    close(figure)
