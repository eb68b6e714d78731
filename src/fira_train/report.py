"""The comparison report: ``report.md`` (a Markdown table) and ``loss.png`` (curves).

Both are built from the run directories alone (``summary.json`` and ``metrics.jsonl`` of each
method), so a report can be regenerated without re-training.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fira_train.json_files import read_json
from fira_train.metrics import read_metrics

MiB = 1024 ** 2


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    if n >= 1024 ** 3:
        return f"{n / 1024 ** 3:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


def _fmt(value: float | None, spec: str) -> str:
    """A number as ``spec``; ``-`` for ``None`` (a non-finite value, :mod:`fira_train.json_files`)."""
    return "-" if value is None else format(value, spec)


def _fmt_count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,}"


def load_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary, metric records) of a finished run directory."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{str(summary_path)!r} not found: the run in {str(run_dir)!r} has not finished")
    summary = read_json(summary_path, hint="delete it and rerun the run with --resume (it is rewritten "
                                           "from the last checkpoint)")
    return summary, read_metrics(run_dir)


def report_table(summaries: list[dict[str, Any]]) -> str:
    """The Markdown table, one row per run, in the given order.

    Throughput is also given relative to ``adamw`` when it is among the runs.
    """
    baseline = next((s["tokens_per_s"] for s in summaries if s["method"] == "adamw"), None)
    header = ("| Method | Rank | T | LR | Val. loss | Val. PPL | Tokens/s | vs AdamW "
              "| Optimizer state | Peak memory | Train time |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for s in summaries:
        rank = "-" if s.get("rank") is None else str(s["rank"])
        gap = str(s["update_proj_gap"]) if s.get("rank") is not None and s["method"] not in ("lora", "relora") else "-"
        relative = f"{100 * s['tokens_per_s'] / baseline:.1f}%" if baseline else "-"
        state = f"{_fmt_count(s['optimizer_state_numel'])} ({_fmt_bytes(s['optimizer_state_bytes'])})"
        lines.append(
            f"| {s['method']} | {rank} | {gap} | {s['lr']:g} | {_fmt(s['val_loss'], '.4f')} "
            f"| {_fmt(s['val_ppl'], '.2f')} "
            f"| {s['tokens_per_s']:,.0f} | {relative} | {state} | {_fmt_bytes(s['peak_memory_bytes'])} "
            f"| {s['train_time_s'] / 60:.1f} min |")
    return "\n".join(lines)


def write_report(out_dir: str | Path, methods: list[str], *, command: str | None = None) -> Path:
    """Write ``OUT/report.md`` for the runs ``OUT/<method>``; returns its path."""
    out_dir = Path(out_dir)
    summaries = [load_run(out_dir / m)[0] for m in methods]
    first = summaries[0]
    data = first.get("data", {})
    memory_kind = {"cuda_max_allocated": "CUDA max_memory_allocated",
                   "process_peak_rss": "peak resident memory of the process during the run"}
    parts = [
        f"# Pre-training comparison: recipe `{first['recipe']}`",
        "",
        f"Same data, tokens and seed for every method: {first['steps']} steps, "
        f"{first['tokens']:,} training tokens, seed {first['seed']}, data `{data.get('source', '?')}` "
        f"({data.get('train_tokens', '?'):,} training tokens available, tokenizer "
        f"`{data.get('tokenizer', '?')}`), model {_fmt_count(first['parameters'])} parameters, "
        f"device `{first['device']}`.",
        "",
        report_table(summaries),
        "",
        "- Val. loss / PPL: mean next-token loss over all "
        f"{first.get('val_tokens', '?'):,} validation tokens after the last step, and its exponential.",
        "- Tokens/s: training tokens divided by the time spent in training steps (evaluation and "
        "checkpoints excluded); `vs AdamW` is the ratio to the `adamw` run.",
        "- Optimizer state: elements held in the optimizer's state (step counters excluded) and "
        "their bytes.",
        f"- Peak memory: {memory_kind.get(first['peak_memory_kind'], first['peak_memory_kind'])}.",
        "- T: subspace update gap (Fira/GaLore family).",
        "",
        "![training loss and validation perplexity](loss.png)",
    ]
    if command:
        parts += ["", "Command:", "", "```bash", command, "```"]
    path = out_dir / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what is available)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(out_dir: str | Path, methods: list[str]) -> Path:
    """Write ``OUT/loss.png``: training loss (smoothed) and validation perplexity per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in methods:
        records = [r for r in read_metrics(out_dir / method) if r.get("loss") is not None]
        steps = [r["step"] for r in records]
        losses = [r["loss"] for r in records]
        window = max(1, len(records) // 50)
        ax_loss.plot(steps, _smooth(losses, window), label=method, linewidth=1.2)
        evals = [(r["step"], r["val_ppl"]) for r in records
                 if r.get("val_ppl") is not None and math.isfinite(r["val_ppl"])]
        if evals:
            ax_ppl.plot(*zip(*evals), marker="o", markersize=3, label=method)
    ax_loss.set(xlabel="step", ylabel="training loss (moving average)", title="Training loss")
    ax_ppl.set(xlabel="step", ylabel="validation perplexity", title="Validation perplexity", yscale="log")
    for ax in (ax_loss, ax_ppl):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out_dir / "loss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
