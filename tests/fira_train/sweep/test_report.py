"""The sweep's report: sweep.json read back as the results it was written from, and the wording of
non-finite differences."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fira_train.sweep.grid import RunKey, RunResult
from fira_train.sweep.report import _difference, read_runs, write_json, write_markdown
from fira_train.sweep.stats import paired_difference
from fira_train.sweep.summary import summarize


def _run(spec: str, seed: int, val: float, test: float | None, diverged: bool = False) -> tuple[RunKey, RunResult]:
    key = RunKey(spec, 0.01, seed)
    return key, RunResult(key, val, test, diverged=diverged)


def _summaries(results: dict[RunKey, RunResult]) -> list:
    return summarize(["fira", "galore"], {"fira": [0.01], "galore": [0.01]}, results, reference="fira",
                     grid_seeds=[0])


def test_sweep_json_reads_back_a_finished_runs_overflowed_test_perplexity(tmp_path: Path) -> None:
    # Fira's seed 1 finished, but its test perplexity overflowed (inf): it must stay in the mean.
    results = dict([_run("fira", 0, 110.0, 104.0), _run("fira", 1, 111.0, math.inf), _run("fira", 2, 109.0, 103.0),
                    _run("galore", 0, 108.0, 102.0), _run("galore", 1, 108.0, 101.0),
                    _run("galore", 2, 107.0, 101.0),
                    _run("adamw", 0, 200.0, None)])  # a run without a test set stays without one
    path = write_json(tmp_path / "sweep.json", {}, results, _summaries(results))
    saved = json.loads(path.read_text())
    assert [r["test_set"] for r in saved["runs"]] == [False, True, True, True, True, True, True]
    again = read_runs(saved)
    assert again == results
    live, reread = _summaries(results), _summaries(again)
    assert reread[0].test_by_seed == live[0].test_by_seed == {0: 104.0, 1: math.inf, 2: 103.0}
    assert math.isinf(reread[1].vs_reference.mean) and reread[1].vs_reference.mean < 0
    # A file written before runs recorded test_set: a finished run's null reads as no test set.
    for run in saved["runs"]:
        del run["test_set"]
    assert read_runs(saved)[RunKey("fira", 0.01, 1)].test_ppl is None


def test_non_finite_differences_say_which_side_diverged(tmp_path: Path) -> None:
    ours = {0: math.inf, 1: 100.0, 2: 101.0}
    assert _difference(paired_difference(ours, {0: 100.0, 1: 99.0, 2: 99.0})).startswith(
        "+inf: this method diverged (n=3")
    assert _difference(paired_difference({0: 100.0, 1: 99.0, 2: 99.0}, ours)).startswith(
        "-inf: the reference diverged (n=3")
    # each side diverged at another seed: no order, and not "both diverged"
    assert _difference(paired_difference(ours, {0: 100.0, 1: math.inf, 2: 99.0})).startswith(
        "no order: runs diverged on both sides")
    results = dict([_run("fira", 0, math.inf, None, diverged=True), _run("galore", 0, 108.0, 102.0)])
    rows = _summaries(results)
    saved = json.loads(write_json(tmp_path / "sweep.json", {}, results, rows).read_text())
    galore = saved["methods"][1]["test_ppl_minus_reference"]
    assert galore["mean"] is None and galore["diverged"] == "reference"
    settings = {"reference": "fira", "seeds": [0], "all_seeds": False, "recipe": "micro"}
    text = write_markdown(tmp_path / "report.md", settings, rows).read_text()
    assert "-inf: the reference diverged" in text and "| galore | 0.01 (one lr: not chosen) |" in text


def test_the_lr_figure_shows_diverged_runs_and_a_method_whose_every_lr_diverged(tmp_path: Path,
                                                                                monkeypatch) -> None:
    """A diverged mean (inf) has no height: it was left out, so a method whose every lr diverged
    was missing from the figure and its legend, and a chosen lr where a seed diverged lost its star."""
    import matplotlib.pyplot as plt

    from fira_train.sweep.report import plot_lr

    inf = math.inf
    results = {}
    for spec, lr, seed, val in [("fira", 0.01, 0, 110.0), ("fira", 0.1, 0, inf), ("fira", 0.01, 1, inf),
                                ("adamw", 1.0, 0, inf), ("adamw", 3.0, 0, inf)]:
        key = RunKey(spec, lr, seed)
        results[key] = RunResult(key, val, inf if math.isinf(val) else val - 5, diverged=math.isinf(val))
    rows = summarize(["fira", "adamw"], {"fira": [0.01, 0.1], "adamw": [1.0, 3.0]}, results, reference="fira",
                     grid_seeds=[0])
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    plot_lr(tmp_path / "lr.png", rows)
    (ax,) = figures[0].axes
    crosses = {(line.get_color(), x) for line in ax.get_lines() if line.get_marker() == "x" for x in line.get_xdata()}
    assert crosses == {("C0", 0.1), ("C1", 1.0), ("C1", 3.0)}
    stars = [line for line in ax.get_lines() if line.get_marker() == "*"]
    assert [(line.get_color(), list(line.get_xdata())) for line in stars] == [("C0", [0.01])]  # seed 1 diverged
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fira", "adamw (every lr diverged)"]
    close(figures[0])
    # every run so far diverged: the figure is still drawn (a log axis without a finite value raised)
    plot_lr(tmp_path / "lr.png", rows[1:])
    (ax,) = figures[1].axes
    assert [x for line in ax.get_lines() if line.get_marker() == "x" for x in line.get_xdata()] == [1.0, 3.0]
    assert ax.get_yticks().size == 0  # no perplexity scale without a perplexity
    close(figures[1])


def test_the_lr_figure_keeps_apart_the_marks_of_methods_that_diverged_at_one_lr(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """Every diverged mark sits at the top edge: two methods that diverged at the same lr drew
    their x at one spot, the later hiding the earlier (a grid with lr 10 for every method showed
    one method diverged there and the other not run), and a chosen lr's star at the top hid under
    another method's x."""
    import matplotlib.pyplot as plt

    from fira_train.sweep.report import plot_lr

    inf = math.inf
    results = {}
    for spec, lr, seed, val in [("fira", 0.01, 0, 110.0), ("fira", 10.0, 0, inf), ("fira", 0.003, 0, 130.0),
                                ("fira", 0.01, 1, inf),  # fira's chosen lr: a seed diverged, its star at the top
                                ("adamw", 0.003, 0, 150.0), ("adamw", 0.01, 0, 160.0), ("adamw", 10.0, 0, inf),
                                ("galore", 0.003, 0, inf), ("galore", 0.01, 0, inf), ("galore", 10.0, 0, inf)]:
        key = RunKey(spec, lr, seed)
        results[key] = RunResult(key, val, inf if math.isinf(val) else val - 5, diverged=math.isinf(val))
    specs = ["fira", "adamw", "galore"]
    rows = summarize(specs, {spec: [0.003, 0.01, 10.0] for spec in specs}, results, reference="fira",
                     grid_seeds=[0])
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    plot_lr(tmp_path / "lr.png", rows)
    figure = figures[0]
    figure.canvas.draw()
    (ax,) = figure.axes
    marks = [(line.get_color(), line.get_marker(), tuple(xy.round(1)))
             for line in ax.get_lines() if line.get_marker() in ("x", "*")
             for xy in line.get_transform().transform(line.get_xydata())]
    at_top = [mark for mark in marks if mark[1] == "x" or mark[0] == "C0"]
    assert {(color, marker) for color, marker, _ in at_top} == {("C0", "x"), ("C1", "x"), ("C2", "x"),
                                                                ("C0", "*")}
    spots = [spot for _, _, spot in at_top]
    assert len(spots) == len(set(spots)) == 6, marks  # fira, adamw, galore at lr 10; fira's star, galore at 0.01
    assert ax.get_xlim()[0] < 0.003 and ax.get_xlim()[1] > 10.0  # every mark's lr inside the figure
    close(figure)


def test_a_diverged_seed_is_counted_and_a_grid_that_all_diverged_chooses_nothing(tmp_path: Path) -> None:
    """One diverged seed of three made the row read "diverged", as if all three had; a method
    with a diverged run at every lr showed the smallest lr (the tie rule) as its chosen one, in bold."""
    inf = math.inf
    results = {}
    for spec, lr, seed, val in [("fira", 0.01, 0, 110.0), ("fira", 0.1, 0, 120.0),  # the grid, at seed 0
                                ("fira", 0.01, 1, inf), ("fira", 0.01, 2, 111.0),  # then the chosen lr
                                ("adamw", 1.0, 0, inf), ("adamw", 3.0, 0, inf)]:
        key = RunKey(spec, lr, seed)
        results[key] = RunResult(key, val, inf if math.isinf(val) else val - 5, diverged=math.isinf(val))
    rows = summarize(["fira", "adamw"], {"fira": [0.01, 0.1], "adamw": [1.0, 3.0]}, results, reference="fira",
                     grid_seeds=[0])
    settings = {"reference": "fira", "seeds": [0, 1, 2], "all_seeds": False, "recipe": "micro"}
    text = write_markdown(tmp_path / "report.md", settings, rows).read_text()
    assert "| fira | 0.01 (at the grid's edge) | diverged (1 of 3 runs) | diverged (1 of 3 runs) |" in text
    assert "| fira | **110.00 (n=1)** | 120.00 (n=1) |" in text  # the grid, the chosen lr in bold
    assert "| adamw | 1 (a run diverged at every lr: none chosen) | diverged (1 of 1 runs) |" in text
    assert "| adamw |  |  | diverged (1 of 1 runs) | diverged (1 of 1 runs) |" in text  # nothing in bold
    # nor a row in the table of each seed "at the chosen lr"
    seeds = text.split("## Each seed at the chosen lr", 1)[1]
    assert "| fira | 0.01 |" in seeds and "| adamw |" not in seeds


def test_sweep_json_of_a_diverged_run_is_written_again_as_it_was(tmp_path: Path) -> None:
    """A diverged run was written with "test_set": false and read back (as summarize takes it) with
    a test set, so --report-only changed the sweep.json of the sweep that had written it."""
    results = dict([_run("fira", 0, math.inf, None, diverged=True), _run("galore", 0, 108.0, 102.0)])
    first = write_json(tmp_path / "sweep.json", {}, results, _summaries(results)).read_bytes()
    again = read_runs(json.loads(first))
    assert write_json(tmp_path / "sweep.json", {}, again, _summaries(again)).read_bytes() == first


def test_the_lr_figure_explains_the_diverged_mark_only_where_one_is_drawn(tmp_path: Path, monkeypatch) -> None:
    """Its title explained 'x on the top edge: diverged' in a figure of a sweep where no run diverged."""
    import matplotlib.pyplot as plt

    from fira_train.sweep.report import plot_lr

    def title(results: dict[RunKey, RunResult]) -> str:
        figures: list = []
        monkeypatch.setattr(plt, "close", figures.append)
        plot_lr(tmp_path / "lr.png", _summaries(results))
        monkeypatch.undo()
        text = figures[0].axes[0].get_title()
        plt.close(figures[0])
        return text

    assert "diverged" not in title(dict([_run("fira", 0, 110.0, 104.0), _run("galore", 0, 108.0, 102.0)]))
    assert "x on the top edge and above it: diverged" in title(
        dict([_run("fira", 0, math.inf, None, diverged=True), _run("galore", 0, 108.0, 102.0)]))


def test_a_sweep_of_one_seed_says_seed_not_seeds(tmp_path: Path) -> None:
    """It read "grid at seeds 0), then trained with seeds 0 at that lr"."""
    results = dict([_run("fira", 0, 110.0, 104.0), _run("galore", 0, 108.0, 102.0)])
    settings = {"reference": "fira", "seeds": [0], "all_seeds": True, "recipe": "micro"}
    text = write_markdown(tmp_path / "report.md", settings, _summaries(results)).read_text()
    assert "grid at seed 0), then trained with seed 0 at that lr" in text
    text = write_markdown(tmp_path / "report.md", {**settings, "seeds": [0, 1]}, _summaries(results)).read_text()
    assert "grid at seeds 0, 1), then trained with seeds 0, 1 at that lr" in text
