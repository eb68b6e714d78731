"""Figure helpers shared by the reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from fira_train.report.plots import plain_log_ticks, pyplot


def _labels(axis, minor: bool) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels(minor=minor) if t.get_text()]


def _plain_labels(xs, ys, log_axes: str) -> tuple[list[str], list[str]]:
    """(major, minor) labels of the log axes ``log_axes`` ("x", "y") of a plot of ``xs``, ``ys``
    with :func:`plain_log_ticks`, the x axis's first."""
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot(xs, ys)
    ax.set(**{f"{a}scale": "log" for a in log_axes})
    axes = [getattr(ax, f"{a}axis") for a in log_axes]
    plain_log_ticks(*axes)
    fig.canvas.draw()
    major = [label for axis in axes for label in _labels(axis, minor=False)]
    minor = [label for axis in axes for label in _labels(axis, minor=True)]
    plt.close(fig)
    return major, minor


def test_plain_log_ticks_write_plain_numbers_on_a_narrow_log_axis():
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([0.02, 0.08], [101.0, 114.0])
    ax.set(xscale="log", yscale="log")
    fig.canvas.draw()
    assert any("10^" in label or "times" in label for label in _labels(ax.yaxis, minor=True))
    plain_log_ticks(ax.xaxis, ax.yaxis)
    fig.canvas.draw()
    y, x = _labels(ax.yaxis, minor=True), _labels(ax.xaxis, minor=True)
    plt.close(fig)
    assert "110" in y and "102" in y
    assert "0.02" in x and "0.03" in x
    assert all(label.replace(".", "").isdigit() for label in y + x), (y, x)


def test_plain_log_ticks_leave_wide_axes_to_the_decades():
    """Over several decades only the decades (and a few minor ticks) carry labels, as before."""
    major, minor = _plain_labels([1, 2], [10.0, 100_000.0], "y")
    assert {"10", "100", "1000", "10000", "100000"} <= set(major)
    assert minor == []


def test_plain_log_ticks_keep_only_1_2_5_on_a_learning_rate_axis():
    """Two decades of learning rates: "0.0003" next to "0.0004" would overlap, so they go."""
    major, minor = _plain_labels([0.0003, 0.05], [1.0, 2.0], "x")
    labels = major + minor
    assert {"0.001", "0.002", "0.005", "0.01", "0.02", "0.05"} <= set(labels)
    assert "0.0003" not in labels and "0.003" not in labels and "0.004" not in labels
    assert labels and all(label.rstrip("0").rstrip(".")[-1] in "125" for label in labels), labels


def test_smoothing_is_centred_so_a_change_shows_at_its_own_step():
    from fira_train.report.plots import smooth

    steps = [0.0] * 10 + [1.0] * 10
    smoothed = smooth(steps, 6)
    assert smoothed[9] == pytest.approx(0.5) and smoothed[10] == pytest.approx(4 / 6)  # half way at the jump
    assert smoothed[:7] == [0.0] * 7 and smoothed[-6:] == [1.0] * 6
    assert smooth([3.0, 5.0], 1) == [3.0, 5.0] and smooth([1.0, 2.0, 3.0], 9) == [2.0] * 3


def test_a_figure_is_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    """A kill or a full disk while a figure was written left a truncated image in its place (a
    sweep rewrites lr.png after every run); the previous one now stays until the new one is whole."""
    from fira_train.report.plots import save_figure

    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    path = save_figure(fig, tmp_path / "lr.png")
    before = path.read_bytes()
    assert before[:4] == b"\x89PNG" and [p.name for p in tmp_path.iterdir()] == ["lr.png"]

    def full_disk(target, **kwargs):
        target.write(b"\x89PNG partial")  # the temporary file's handle
        raise OSError(28, "No space left on device")

    fig.savefig = full_disk
    with pytest.raises(OSError, match="No space"):
        save_figure(fig, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["lr.png"]
    plt.close(fig)


def test_a_figure_is_never_written_through_a_link_at_its_temporary_name(tmp_path: Path) -> None:
    """save_figure wrote the image through whatever its temporary name pointed to (a link planted
    there: the link's target overwritten with a PNG), then renamed the link over the figure; it
    now writes as write_text_atomic does, the temporary file made afresh (O_EXCL)."""
    from fira_train.report.plots import save_figure

    target = tmp_path / "target.txt"
    target.write_text("precious\n")
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    for name in ("lr.png.tmp", ".lr.png.tmp"):
        (tmp_path / name).symlink_to(target)
    path = save_figure(fig, tmp_path / "lr.png")
    plt.close(fig)
    assert target.read_text() == "precious\n"
    assert not path.is_symlink() and path.read_bytes()[:4] == b"\x89PNG"
