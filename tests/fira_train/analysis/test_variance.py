"""Variance of the scaling factor (Appendix E.2): simulation, Theorem 2 check, report."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fira_train.analysis.variance import (
    check_theorem2,
    run_variance_analysis,
    scale_inv_chi2_moments,
    simulate_scaling_variance,
)


@pytest.fixture(scope="module")
def curves():
    return simulate_scaling_variance((1, 5, 10, 50, 100), steps=30, samples=2000, seed=0)


def test_variance_decreases_with_rank(curves):
    finite = curves.steps >= 3  # rank 1 has infinite variance at t <= 2
    assert np.all(np.diff(curves.var_adam[:, finite], axis=0) < 0)
    assert np.all(np.diff(curves.var_past[:, curves.steps >= 4], axis=0) < 0)


def test_variance_is_largest_early(curves):
    for k in range(len(curves.ranks)):
        assert curves.var_adam[k, 2] > 3 * curves.var_adam[k, -1]


def test_first_step_matches_closed_form(curves):
    """At t = 1, v_hat = g^2, so phi^2 = n / chi^2_n exactly: compare Var[phi] to its value."""
    for k, n in enumerate(curves.ranks):
        if n < 50:
            continue
        mean_sq = n / (n - 2)
        mean = math.sqrt(n / 2) * math.exp(math.lgamma((n - 1) / 2) - math.lgamma(n / 2))
        exact = mean_sq - mean**2
        assert curves.var_adam[k, 0] == pytest.approx(exact, rel=0.2)


def test_rank_one_is_psi(curves):
    np.testing.assert_array_equal(curves.var_adam[0], curves.var_psi_adam)
    np.testing.assert_allclose(curves.ratio("adam")[0], 1.0)


@pytest.mark.parametrize("n", [1, 5, 50])
def test_theorem2_identity_within_monte_carlo_error(n):
    (row,) = check_theorem2([n], rho=20.0, samples=100_000, seed=0)
    assert row["formula"] == pytest.approx(3 / (n + 2))
    assert row["mc_se"] > 0
    assert abs(row["mc_ratio"] - row["formula"]) < 4 * row["mc_se"]
    assert row["mean_ratio"] == pytest.approx(1.0, abs=0.01)


def test_theorem2_check_detects_a_wrong_formula():
    """The check has power: equal weights w_i = 1/n would give 1/n, and it is rejected."""
    for n in (5, 50):
        (row,) = check_theorem2([n], rho=20.0, samples=100_000, seed=0)
        assert abs(row["mc_ratio"] - 1 / n) > 10 * row["mc_se"]


def test_scale_inv_chi2_moments_against_sampling():
    rng = np.random.default_rng(1)
    psi2 = 12.0 / rng.chisquare(12.0, size=400_000)
    exact = scale_inv_chi2_moments(12.0)
    assert psi2.mean() == pytest.approx(exact["mean_psi2"], rel=0.01)
    assert np.sqrt(psi2).var() == pytest.approx(exact["var_psi"], rel=0.02)


def test_fixed_seed_is_deterministic():
    a = simulate_scaling_variance((1, 5), steps=5, samples=200, seed=3)
    b = simulate_scaling_variance((1, 5), steps=5, samples=200, seed=3)
    c = simulate_scaling_variance((1, 5), steps=5, samples=200, seed=4)
    np.testing.assert_array_equal(a.var_adam, b.var_adam)
    np.testing.assert_array_equal(a.var_past, b.var_past)
    assert not np.array_equal(a.var_adam, c.var_adam)
    assert check_theorem2([5], samples=1000, seed=3) == check_theorem2([5], samples=1000, seed=3)


def test_run_writes_report_and_figure(tmp_path):
    result = run_variance_analysis(tmp_path / "out", samples=300, steps=12, theorem_samples=5000,
                                   command="pytest", machine="test")
    report = (tmp_path / "out" / "report.md").read_text()
    assert result["report"] == tmp_path / "out" / "report.md"
    assert (tmp_path / "out" / "variance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for text in ("| rank | t=1 |", "3/(n+2)", "Paper vs measured", "Command: `pytest`", "Machine: test"):
        assert text in report
    assert result["summary"]["checked_steps"] == 10


def test_a_sweeps_folder_is_refused_before_its_report_exists(tmp_path):
    """A sweep's folder holds sweep.json from its start, its report.md only once a run finished:
    the variance analysis wrote its report there, which the sweep then could not write."""
    (tmp_path / "sweep.json").write_text("{}")
    with pytest.raises(FileExistsError, match=r"holds a sweep \(`fira-train sweep`.*choose a fresh --out"):
        run_variance_analysis(tmp_path, samples=300, steps=12, theorem_samples=5000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json"]


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: simulate_scaling_variance((5, 1)), "ranks"),
        (lambda: simulate_scaling_variance((0, 5)), "ranks"),
        (lambda: simulate_scaling_variance(samples=1), "samples"),
        (lambda: simulate_scaling_variance(steps=0), "steps"),
        (lambda: simulate_scaling_variance(beta2=1.0), "beta2"),
        (lambda: check_theorem2([5], rho=4.0), "rho"),
    ],
)
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("samples", [0, -5, 1])
def test_the_command_names_its_samples_flag(tmp_path, samples):
    """``analyze variance --samples 0`` said "samples must be a positive int": every other bad
    value of the analyses names its flag."""
    with pytest.raises(ValueError, match=rf"samples must be an int >= 2 \(--samples\).*got samples={samples}"):
        run_variance_analysis(tmp_path / "out", samples=samples, steps=5)
    assert not (tmp_path / "out").exists()


def test_the_step_axes_read_as_plain_numbers(tmp_path, monkeypatch):
    """With --steps 50 the ratio panel's step axis spans one decade, and matplotlib labelled its
    minor ticks "6 x 10^0", "2 x 10^1", "3 x 10^1", "4 x 10^1"."""
    import matplotlib.pyplot as plt

    from fira_train.analysis.variance import _plot

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    _plot(simulate_scaling_variance((1, 5), steps=50, samples=50, seed=0), tmp_path / "variance.png")
    figure = figures[0]
    figure.canvas.draw()
    for ax in figure.axes:
        labels = [t.get_text() for t in (*ax.xaxis.get_majorticklabels(), *ax.xaxis.get_minorticklabels())
                  if t.get_text() and t.get_visible()]
        assert labels and not any("times" in label or "^" in label for label in labels), labels
    close(figure)
