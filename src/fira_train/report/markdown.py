"""The comparison report ``report.md``: a Markdown table of the runs' summaries.

It is built from the run directories alone (``summary.json`` of each method), like the curves
of :mod:`fira_train.report.plots`, so a report can be regenerated without re-training.
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fira_train.files import ANALYSIS_RUN_FILE, read_json, report_heading, write_text_atomic
from fira_train.provenance import source_of
from fira_train.run.metrics import read_metrics

MiB = 1024 ** 2


#: The first words of the report ``fira-train compare`` writes.
REPORT_TITLE = "# Pre-training comparison"
#: The first words of the report ``fira-train sweep`` writes (kept here, below both commands, so
#: that another command can tell a sweep's folder).
SWEEP_REPORT_TITLE = "# Learning-rate sweep"


#: The folders of other commands an analysis's ``--out`` may name: (what it holds, its report's
#: heading, a file of its own besides).
OTHER_COMMANDS = (("a sweep (`fira-train sweep`: sweep.json, its runs in <spec>/lr=<lr>/seed=<seed>/)",
                   SWEEP_REPORT_TITLE, "sweep.json"),
                  ("a comparison (`fira-train compare`: its runs in <method>/)", REPORT_TITLE, None))


def refuse_other_commands_output(out_dir: Path, own: str | None = None, writer: str = "an analysis's",
                                 *, analyses: bool = False) -> None:
    """FileExistsError if ``out_dir`` holds another command's results (:data:`OTHER_COMMANDS`, but
    for the command whose report heading is ``own``; with ``analyses``, an analysis's too:
    :func:`holds_analysis`), with or without ``--overwrite``: ``writer`` (an analysis,
    ``fira-train analyze``; a comparison) would write its report over theirs and its runs beside
    (or over) theirs, and the folder would be neither's; a fresh ``--out`` is the way on."""
    first = report_heading(out_dir)
    others = [(what, heading, record) for what, heading, record in OTHER_COMMANDS if heading != own]
    found = next((what for what, heading, record in others
                  if first.startswith(heading) or (record is not None and (out_dir / record).is_file())), None)
    if found is None and analyses and holds_analysis(out_dir):
        found = f"an analysis (`fira-train analyze`: its runs in <run>/, each with {ANALYSIS_RUN_FILE})"
    if found is not None:
        raise FileExistsError(f"--out {str(out_dir)!r} holds {found}, another command's results, which {writer} "
                              "runs and report.md would mix with or replace, --overwrite or not: choose a fresh "
                              "--out")


#: The line of an analysis's report that says how it was run (``fira_train.analysis.runs.report_header``,
#: the variance analysis's own): it tells an analysis's folder from a folder with a report.md of the user's.
ANALYSIS_COMMAND = re.compile(r"^- Command: (`fira-train analyze |\(called from Python\)|not recorded)", re.M)


def analysis_heading(out_dir: Path) -> str | None:
    """The heading of the report.md of an analysis (``fira-train analyze``) in ``out_dir``, else None."""
    heading = report_heading(out_dir)
    if not heading:
        return None
    with open(out_dir / "report.md", encoding="utf-8", errors="replace") as handle:
        head = handle.read(4096)
    return heading if ANALYSIS_COMMAND.search(head) else None


def holds_analysis(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds an analysis's results: its report.md, or a run of one (a folder
    holding :data:`~fira_train.files.ANALYSIS_RUN_FILE`, written before the report)."""
    if analysis_heading(out_dir):
        return True
    try:
        return any(_holds_analysis_run(child) for child in out_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return False


def _holds_analysis_run(folder: Path) -> bool:
    """Whether ``folder`` is a run of an analysis's; a folder that cannot be read (a mount point's
    root-only ``lost+found``: PermissionError) holds none."""
    try:
        return folder.is_dir() and (folder / ANALYSIS_RUN_FILE).is_file()
    except OSError:
        return False


def command_line(argv: Sequence[str]) -> str:
    """``fira-train`` with ``argv``, shell-quoted: the command a report records."""
    return "fira-train " + " ".join(shlex.quote(a) for a in argv)


def format_bytes(n: float | None) -> str:
    """``n`` bytes in MiB, or GiB from 1 GiB on (``-`` for None)."""
    if n is None:
        return "-"
    if n >= 1024 ** 3:
        return f"{n / 1024 ** 3:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


def _fmt(value: float | None, spec: str) -> str:
    """A number as ``spec``; ``-`` for ``None`` (a non-finite value, :func:`fira_train.files.dumps`)."""
    return "-" if value is None else format(value, spec)


def format_duration(seconds: float) -> str:
    """A training time in minutes (one decimal), or in seconds under a minute: a run of a few
    seconds read "0.0 min", as if it took no time."""
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def format_count(n: int) -> str:
    """A count in millions from 100,000 on, else with thousands separators."""
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


def code_line(codes: Sequence[str | None]) -> str:
    """Which code made the runs (their ``source`` digests, None: not recorded), in one sentence."""
    counts = Counter(codes)
    if not counts:
        return "Code: no run yet."
    if len(counts) == 1:
        (source, n), = counts.items()
        return (f"Code: every run ({n}) was made by source `{source}`." if source else
                f"Code: no run ({n}) recorded the code that made it (made before runs recorded it).")
    parts = [f"source `{source}` {n}" if source else f"not recorded {n}"
             for source, n in sorted(counts.items(), key=lambda item: (item[0] is None, -item[1], item[0] or ""))]
    return (f"Code: the runs were made by {len(counts)} versions of the code (runs of each: {', '.join(parts)}); "
            "a fix made between them may change the numbers, and each run's `summary.json` names its code.")


def report_table(summaries: list[dict[str, Any]], labels: list[str] | None = None) -> str:
    """The Markdown table, one row per run, in the given order, labelled by ``labels`` (the
    method specs of ``compare``; default: each run's method).

    Throughput is also given relative to ``adamw`` when it is among the runs. A "Test PPL"
    column follows "Val. PPL" when a run was evaluated on a held-out test set.
    """
    labels = labels or [s["method"] for s in summaries]
    # the run labelled plain "adamw" where there is one, else the first AdamW run (a spec)
    runs = list(zip(labels, summaries))
    baseline = next((s["tokens_per_s"] for label, s in runs if label == "adamw"),
                    next((s["tokens_per_s"] for _, s in runs if s["method"] == "adamw"), None))
    with_test = any(s.get("test_ppl") is not None for s in summaries)
    header = (f"| Method | Rank | T | LR | Val. loss | Val. PPL |{' Test PPL |' * with_test} Tokens/s | vs AdamW "
              "| Optimizer state | Peak memory | Train time |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for label, s in zip(labels, summaries):
        rank = "-" if s.get("rank") is None else str(s["rank"])
        gap = str(s["update_proj_gap"]) if s.get("rank") is not None and s["method"] not in ("lora", "relora") else "-"
        relative = f"{100 * s['tokens_per_s'] / baseline:.1f}%" if baseline else "-"
        state = f"{format_count(s['optimizer_state_numel'])} ({format_bytes(s['optimizer_state_bytes'])})"
        lines.append(
            f"| {label} | {rank} | {gap} | {s['lr']:g} | {_fmt(s['val_loss'], '.4f')} "
            f"| {_fmt(s['val_ppl'], '.2f')} "
            + (f"| {_fmt(s.get('test_ppl'), '.2f')} " if with_test else "")
            + f"| {s['tokens_per_s']:,.0f} | {relative} | {state} | {format_bytes(s['peak_memory_bytes'])} "
            f"| {format_duration(s['train_time_s'])} |")
    return "\n".join(lines)


def _per_method(methods: Sequence[str], summaries: list[dict[str, Any]], key: str, one: str, by: str, show) -> str:
    """``one`` with the runs' ``key`` where all share it (``model {} parameters``), else ``by`` and
    each method's: a spec may change the model (``fira@model.*``) or the device, and the first
    run's value alone would be said of every run."""
    values = [s[key] for s in summaries]
    if len(set(values)) == 1:
        return one.format(show(values[0]))
    return f"{by}: " + ", ".join(f"{m} {show(v)}" for m, v in zip(methods, values))


def _launch(summary: dict[str, Any]) -> str:
    """Where a run's peak was measured: rank 0 of a ``--parallel`` launch, else its own process."""
    if summary.get("parallel"):
        return f"on rank 0 of {summary['world_size']} processes (`--parallel {summary['parallel']}`)"
    return "in a fresh process"


def _launches(methods: Sequence[str], summaries: list[dict[str, Any]]) -> str:
    """The end of the peak memory note: the runs' launch, each method's where they differ (a
    comparison resumed in another ``--parallel`` mode, or in one process, finishes its unfinished
    runs so: the first run's launch alone would be said of every run)."""
    launches = [_launch(s) for s in summaries]
    several = " which train the runs one after another, the peak reset for each run."
    if len(set(launches)) == 1:
        return f" {launches[0]},{several}" if summaries[0].get("parallel") else " (each run in a fresh process)."
    by_method = ", ".join(f"{m} {launch}" for m, launch in zip(methods, launches))
    return (f", launch by method: {by_method}; the processes of a launch train its runs one after another, "
            "the peak reset for each run.")


def write_report(out_dir: str | Path, methods: list[str], *, command: str | None = None) -> Path:
    """Write ``OUT/report.md`` for the runs ``OUT/<method>``; returns its path."""
    out_dir = Path(out_dir)
    summaries = [load_run(out_dir / m)[0] for m in methods]
    first = summaries[0]
    data = first.get("data") or {}
    available = data.get("train_tokens")  # None for a streamed corpus: its length is not known
    available = f"{available:,} training tokens available" if isinstance(available, int) else "streamed"
    model = _per_method(methods, summaries, "parameters", "model {} parameters", "model parameters by method",
                        format_count)
    device = _per_method(methods, summaries, "device", "device {}", "device by method", lambda d: f"`{d}`")
    memory_kind = {"cuda_max_allocated": "CUDA max_memory_allocated",
                   "process_peak_rss": "peak resident memory of the run's process"}
    parts = [
        f"{REPORT_TITLE}: recipe `{first['recipe']}`",
        "",
        f"Same data, tokens and seed for every method: {first['steps']} steps, "
        f"{first['tokens']:,} training tokens, seed {first['seed']}, data `{data.get('source', '?')}` "
        f"({available}, tokenizer "
        f"`{data.get('tokenizer', '?')}`), {model}, {device}.",
        "",
        report_table(summaries, list(methods)),
        "",
        "- Val. loss / PPL: mean next-token loss over all "
        f"{first.get('val_tokens', '?'):,} validation tokens after the last step, and its exponential."
        + (f" Test PPL: the same on the {first['test_tokens']:,} tokens of the held-out test set "
           "(held out from training and validation), evaluated once after the last step."
           if first.get("test_ppl") is not None else ""),
        "- Tokens/s: training tokens divided by the time spent in training steps (evaluation and "
        "checkpoints excluded); `vs AdamW` is the ratio to the `adamw` run (the first AdamW spec where "
        "none is plain `adamw`).",
        "- Optimizer state: elements held in the optimizer's state (step counters excluded) and "
        "the bytes of its tensors (step counters included).",
        "- Peak memory: "
        + _per_method(methods, summaries, "peak_memory_kind", "{}", "by method",
                      lambda kind: memory_kind.get(kind, kind))
        + _launches(methods, summaries),
        "- T: subspace update gap (Fira/GaLore family).",
        "",
        "![training loss and validation perplexity](loss.png)",
    ]
    parts += ["", code_line([source_of(s) for s in summaries])]
    if command:
        parts += ["", "Command:", "", "```bash", command, "```"]
    path = out_dir / "report.md"
    write_text_atomic(path, "\n".join(parts) + "\n")
    return path
