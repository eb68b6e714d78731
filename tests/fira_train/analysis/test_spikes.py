"""Spikes: per-step norms, the limiter's bound on ||S_t|| growth, spike statistics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fira_train.analysis.callbacks import NORMS_FILE
from fira_train.analysis.spikes import run_spikes, spike_statistics
from fira_train.files import read_json_lines
from tests.fira_train.analysis.analysis_fixtures import analysis_config, corpus_root  # noqa: F401


def test_spike_statistics_find_a_spike_after_a_refresh() -> None:
    losses = [5.0, 4.9, 4.8, 4.7, 4.6, 4.5, 6.0, 4.4, 4.3, 4.2, 4.1, 5.5, 4.0]
    # T = 5: new bases at steps 6 and 11, their first effect at steps 7 and 12
    stats = spike_statistics(losses, gap=5)
    assert stats["max_rise"] == pytest.approx(1.5) and stats["max_rise_step"] == 7
    assert stats["spikes"] == 2
    assert stats["mean_change_after_refresh"] == pytest.approx((1.5 + 1.4) / 2)
    assert stats["mean_change_elsewhere"] < 0
    with pytest.raises(ValueError, match="gap"):
        spike_statistics(losses, gap=0)


def test_spikes_end_to_end(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=8", "optim.update_proj_gap=3")
    out = tmp_path / "spikes"
    result = run_spikes(config, out, galore_rank=8)
    for name in ("fira", "fira-no-limiter", "fira-clip", "galore", "galore-add"):
        records = read_json_lines(out / name / NORMS_FILE)
        assert [r["step"] for r in records] == list(range(1, 9))
        assert all(r["grad_norm"] > 0 for r in records)
        assert ("residual_norm" in records[0]) == (name != "galore")
    # the limiter: ||S_t|| of every matrix grows at most by gamma = 1.01 per step, so the global
    # norm does too; without it the growth is unbounded
    fira = [r["residual_norm"] for r in read_json_lines(out / "fira" / NORMS_FILE)]
    assert all(b <= 1.01 * a * (1 + 1e-5) for a, b in zip(fira, fira[1:]))
    free = [r["residual_norm"] for r in read_json_lines(out / "fira-no-limiter" / NORMS_FILE)]
    assert max(b / a for a, b in zip(free, free[1:])) > 1.01
    assert set(result["stats"]) == {"fira", "fira-no-limiter", "fira-clip", "galore", "galore-add"}
    assert all(math.isfinite(s["max_rise"]) for s in result["stats"].values())
    text = result["report"].read_text()
    assert "| galore-add |" in text and "T = 3" in text and "rank 8 for galore, galore-add" in text
    assert json.loads((out / "galore" / "config.json").read_text())["optim"]["rank"] == 8
    assert json.loads((out / "fira" / "config.json").read_text())["optim"]["rank"] == 16
    assert result["figure"].read_bytes()[:4] == b"\x89PNG"


def test_a_run_too_short_to_refresh_reports_no_change_after_refresh_not_nan(tmp_path: Path,
                                                                            corpus_root: Path) -> None:
    """4 steps at T = 3: the refresh is at step 4, the last, and the loss after it (step 5) is not
    measured. The table's cell read nan where its other empty cells read "-", and the measured line
    "+nan"; then "no refresh in the run", of a run whose figure marks a refresh at step 4."""
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=4", "optim.update_proj_gap=3")
    result = run_spikes(config, tmp_path / "spikes", galore_rank=8)
    assert all(math.isnan(s["mean_change_after_refresh"]) for s in result["stats"].values())
    text = result["report"].read_text()
    assert "nan" not in text.lower(), text
    assert "galore none (no loss measured after a refresh) vs" in text
    assert "no refresh in the run" not in text


def test_reused_runs_with_cut_or_damaged_records_are_named_not_reported(tmp_path: Path, corpus_root: Path) -> None:
    """A finished run's norms.jsonl cut by hand gave a report of its first steps as the run's (a
    "final loss" of step 3 of 8), and a damaged line a bare json error naming no file."""
    from fira_train.files import DamagedFileError

    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=4")
    out = tmp_path / "spikes"
    run_spikes(config, out, limiter_runs=("fira",), galore_runs=())
    norms = out / "fira" / NORMS_FILE
    whole = norms.read_text()
    lines = whole.splitlines(keepends=True)
    for text, match in [("".join(lines[:2]), r"2 records \(steps 1\.\.2\) where the finished run updated at 4 of its 4"),
                        ("".join(lines[:3]) + lines[3][:20], "line 4 is not valid JSON"),
                        ("", r"0 records \(no step\)")]:
        norms.write_text(text)
        with pytest.raises(DamagedFileError, match=f"fira/{NORMS_FILE} is damaged .*{match}.*--overwrite"):
            run_spikes(config, out, limiter_runs=("fira",), galore_runs=(), reuse=True)
    norms.unlink()
    with pytest.raises(FileNotFoundError, match=f"fira/{NORMS_FILE}' is missing.*--overwrite"):
        run_spikes(config, out, limiter_runs=("fira",), galore_runs=(), reuse=True)
    norms.write_text(whole)
    assert "| fira |" in run_spikes(config, out, limiter_runs=("fira",), galore_runs=(), reuse=True)["report"].read_text()


def test_the_refresh_marks_stand_apart_from_the_grid(tmp_path: Path, monkeypatch) -> None:
    """The title's "grey: refresh steps" lines were drawn as the grid's vertical lines are (thin,
    light grey, solid): no reader could tell which vertical line was a refresh."""
    import matplotlib.pyplot as plt

    from fira_train.analysis.spikes import _plot

    records = {name: [{"step": s, "loss": 5.0 - 0.01 * s, "grad_norm": 1.0, "residual_norm": 2.0}
                      for s in range(1, 21)] for name in ("fira", "galore")}
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    _plot(records, ["fira"], ["galore"], gap=5, steps=20, path=tmp_path / "spikes.png")
    figure = figures[0]
    figure.canvas.draw()
    for ax in figure.axes:
        refresh = [line for line in ax.get_lines() if list(line.get_xdata()) in ([6, 6], [11, 11], [16, 16])]
        assert len(refresh) == 3, ax.get_title()
        styles = {line.get_linestyle() for line in refresh}
        grid = {line.get_linestyle() for line in ax.xaxis.get_gridlines() if line.get_visible()}
        assert not styles & grid, (styles, grid)
        assert all(float(tick).is_integer() for tick in ax.get_xticks())  # steps, not 2.5
    close(figure)


def test_a_loss_that_fell_at_every_step_shows_no_rise(tmp_path: Path, corpus_root: Path) -> None:
    """A run whose loss fell at every step read "max 1-step loss rise -0.034" and "largest rise
    -0.034": its smallest drop, given as a rise."""
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=4", "optim.update_proj_gap=3")
    result = run_spikes(config, tmp_path / "spikes", limiter_runs=["fira", "fira-no-limiter", "fira-clip"],
                        galore_runs=[], galore_rank=8)
    assert all(s["max_rise"] < 0 for s in result["stats"].values())  # the premise: the loss fell at each step
    text = result["report"].read_text()
    assert "| fira | none | - | 0 |" in text, text
    assert "spikes (count / largest rise) fira 0 / none, fira-no-limiter 0 / none, fira-clip 0 / none;" in text
