"""Gap sweep: one run per method, update gap and seed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fira_train.analysis.gap_sweep import gap_sweep_runs, run_gap_sweep
from tests.fira_train.analysis.analysis_fixtures import analysis_config, corpus_root  # noqa: F401


def test_gap_sweep_end_to_end(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=5")
    out = tmp_path / "gaps"
    result = run_gap_sweep(config, out, gaps=(5, 1), methods=("fira", "galore"), seeds=(0, 1))
    assert set(result["table"]) == {"fira", "galore"} and set(result["table"]["fira"]) == {1, 5}
    for name, gap, seed in (("fira-T1-s0", 1, 0), ("galore-T5-s1", 5, 1)):
        saved = json.loads((out / name / "config.json").read_text())
        assert saved["optim"]["update_proj_gap"] == gap and saved["train"]["seed"] == seed
    values = result["values"]["fira"][1]
    assert values == [json.loads((out / f"fira-T1-s{s}" / "summary.json").read_text())["val_ppl"] for s in (0, 1)]
    assert values[0] != values[1]  # the seed changes the run
    assert result["table"]["fira"][1] == pytest.approx(sum(values) / 2)
    assert result["values"]["fira"][1] != result["values"]["fira"][5]  # so does the gap
    text = result["report"].read_text()
    assert "T = 1 (5 refreshes)" in text and "T = 5 (1 refresh)" in text and "spread" in text
    assert "| fira, seed 1 |" in text and "fira's mean below galore's at" in text
    pairs = {g: sum(a < b for a, b in zip(result["values"]["fira"][g], result["values"]["galore"][g])) for g in (1, 5)}
    assert f"seed by seed, fira below galore at T = 1 in {pairs[1]} of 2, T = 5 in {pairs[5]} of 2 seeds." in text
    # the header names every seed the sweep ran (not the config's one seed), and the rank
    budget = next(line for line in text.splitlines() if line.startswith("- Budget:"))
    assert "seeds 0, 1, T = " in budget and "seed 0," not in budget
    assert "(mean over seeds 0, 1) at rank 16;" in text
    ref = result["values"]["fira"][5]
    changes = [100 * (a / b - 1) for a, b in zip(values, ref)]
    assert f"T = 1 {sum(changes) / 2:+.1f}% ({changes[0]:+.1f}% / {changes[1]:+.1f}%)" in text
    assert result["figure"].read_bytes()[:4] == b"\x89PNG"


def test_per_seed_table_keeps_the_means_decimals(tmp_path: Path, corpus_root: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two seeds that agree to 4 significant digits (the tables' default) are told apart, with the
    two decimals of the means beside them."""
    import fira_train.analysis.gap_sweep as gap_sweep

    ppl = {"fira-T1-s0": 110.934, "fira-T1-s1": 110.871, "fira-T5-s0": 120.0, "fira-T5-s1": 121.456}

    def trained(config, runs, out, **kwargs):  # the runs' summaries, without training them
        out.mkdir(parents=True)
        return {r.name: {"val_ppl": ppl[r.name]} for r in runs}

    monkeypatch.setattr(gap_sweep, "train_runs", trained)
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=5")
    text = run_gap_sweep(config, tmp_path / "gaps", gaps=(1, 5), methods=("fira",), seeds=(0, 1))["report"].read_text()
    assert "| fira, seed 0 | 110.93 | 120.00 |" in text and "| fira, seed 1 | 110.87 | 121.46 |" in text
    assert "| fira | 110.90 (spread 0.06) | 120.73 (spread 1.46) |" in text


def test_report_header_names_one_seed_or_several(tmp_path: Path, corpus_root: Path) -> None:
    from fira_train.analysis.runs import budget_description

    config = analysis_config(corpus_root, tmp_path / "run", "train.seed=3")
    assert ", seed 3, T = " in budget_description(config)
    assert ", seed 3, T = " in budget_description(config, [3])
    assert ", seeds 0, 1, 2, T = " in budget_description(config, [0, 1, 2])


def test_gap_sweep_one_seed_names_runs_without_it() -> None:
    runs = gap_sweep_runs(["fira"], [6, 12], [3])
    assert [r.name for r in runs] == ["fira-T6", "fira-T12"]
    assert runs[1].overrides == ("optim.update_proj_gap=12", "train.seed=3")
    assert [r.name for r in gap_sweep_runs(["galore"], [6], [0, 1])] == ["galore-T6-s0", "galore-T6-s1"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gaps": (0,)}, "gaps (--gaps) must be ints in [1, steps=20] (--steps), got 0"),
    ({"gaps": (21,)}, "steps=20] (--steps), got 21"),
    ({"gaps": (2,), "methods": ("adamw",)}, "'adamw' refreshes no projection"),
    ({"gaps": (2,), "seeds": (1, 1)}, "seeds (--seeds) must be distinct"),
    ({"gaps": (2,), "seeds": (-1,)}, "seeds (--seeds) must be ints >= 0, got -1"),
])
def test_gap_sweep_rejects_bad_input(kwargs: dict, message: str, tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run")
    with pytest.raises(ValueError, match=re.escape(message)):
        run_gap_sweep(config, tmp_path / "x", **kwargs)


@pytest.mark.parametrize("seeds, labels", [
    (2, ["fira: mean over seeds", "fira: each seed", "galore: mean over seeds", "galore: each seed"]),
    (1, ["fira", "galore"]),
])
def test_the_legend_tells_the_seeds_dots_from_the_means(seeds: int, labels: list[str], tmp_path: Path,
                                                         monkeypatch) -> None:
    """With several seeds each seed's run was drawn as a small dot beside the mean's line, and the
    legend named the lines alone: nothing said what the dots were."""
    import matplotlib.pyplot as plt

    from fira_train.analysis.gap_sweep import _plot

    values = {m: {3: [200.0 + i for i in range(seeds)], 6: [210.0 + i for i in range(seeds)]}
              for m in ("fira", "galore")}
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    _plot(values, [3, 6], tmp_path / "gaps.png")
    legend = figures[0].axes[0].get_legend()
    assert [text.get_text() for text in legend.get_texts()] == labels
    close(figures[0])
