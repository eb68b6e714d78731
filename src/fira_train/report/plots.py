"""The comparison's curves ``loss.png``, and the figure helpers the analyses share.

Built from the run directories alone (``metrics.jsonl`` of each method).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

from fira_train.files import write_atomic
from fira_train.run.metrics import read_metrics


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    # Imported here, when a figure is drawn: choosing the backend is a process-wide side effect
    # that merely importing a report module must not have.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """``fig.savefig(path, dpi=120)``, atomically: written beside ``path`` and renamed over it, so
    a kill or a full disk mid-write leaves the previous figure whole (a sweep rewrites ``lr.png``
    after every run), not a truncated image; the partial file is removed on an error. Written as
    :func:`fira_train.files.write_atomic` writes (never through a link planted at the temporary
    name, flushed to disk before the rename)."""
    path = Path(path)
    image_format = path.suffix.lstrip(".") or "png"
    return write_atomic(path, lambda handle: fig.savefig(handle, dpi=120, format=image_format))


def plain_log_ticks(*axes) -> None:
    """Label log-scale axes with plain numbers ("110", "0.02") instead of powers of ten.

    Perplexities in a figure usually span less than a decade, where matplotlib's default labels
    every minor tick as "1.1 x 10^2". Matplotlib chooses which ticks carry a label, except on an
    axis spanning one to three decades (a learning-rate axis): there the ticks at 1, 2 and 5 times a
    power of ten carry one, so that long labels such as "0.0003" and "0.0004" do not run into each
    other.
    """
    from matplotlib.ticker import LogFormatter

    class _Plain(LogFormatter):
        def __call__(self, x, pos=None):
            if x <= 0:
                return ""
            low, high = sorted(self.axis.get_view_interval()) if self.axis is not None else (x, x)
            if low > 0 and 1 < math.log10(high / low) <= 3:
                mantissa = x / 10 ** math.floor(math.log10(x) + 1e-9)
                return f"{x:g}" if min(abs(mantissa - m) for m in (1, 2, 5)) < 1e-6 else ""
            return f"{x:g}" if super().__call__(x, pos) else ""

    for axis in axes:
        axis.set_major_formatter(_Plain(labelOnlyBase=False))
        axis.set_minor_formatter(_Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def smooth(values: list[float], window: int) -> list[float]:
    """Centred moving average over ``window`` points (fewer at the ends: what is available), so
    a change shows at its own step (a trailing average drew it (window - 1) / 2 steps late)."""
    before, after = (window - 1) // 2, window // 2
    prefix = [0.0, *itertools.accumulate(values)]
    out = []
    for i in range(len(values)):
        low, high = max(i - before, 0), min(i + after + 1, len(values))
        out.append((prefix[high] - prefix[low]) / (high - low))
    return out


def plot_curves(out_dir: str | Path, methods: Sequence[str], path: str | Path | None = None) -> Path:
    """Write ``OUT/loss.png`` (or ``path``): training loss (smoothed) and validation perplexity of
    the runs ``OUT/<method>/``, one line per method."""
    plt = pyplot()
    out_dir = Path(out_dir)
    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in methods:
        records = [r for r in read_metrics(out_dir / method) if r.get("loss") is not None]  # null: not finite
        steps = [r["step"] for r in records]
        losses = [r["loss"] for r in records]
        window = max(1, len(records) // 50)
        ax_loss.plot(steps, smooth(losses, window), label=method, linewidth=1.2)
        evals = [(r["step"], r["val_ppl"]) for r in records
                 if r.get("val_ppl") is not None and math.isfinite(r["val_ppl"])]
        if evals:
            ax_ppl.plot(*zip(*evals), marker="o", markersize=3, label=method)
    ax_loss.set(xlabel="step", ylabel="training loss (centred moving average)", title="Training loss")
    ax_ppl.set(xlabel="step", ylabel="validation perplexity", title="Validation perplexity", yscale="log")
    plain_log_ticks(ax_ppl.yaxis)
    for ax in (ax_loss, ax_ppl):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7 if len(methods) > 4 else None)  # an analysis's many variants
    fig.tight_layout()
    path = Path(path) if path is not None else out_dir / "loss.png"
    save_figure(fig, path)
    plt.close(fig)
    return path
