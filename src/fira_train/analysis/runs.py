"""What every training analysis shares: a list of runs, trained one after another, and the report.

An analysis is a thin layer over :func:`fira_train.run.train.train`: it names its runs
(:class:`AnalysisRun`: a method, ``key=value`` overrides and optional callbacks), trains them
on one shared corpus into ``OUT/<run name>/`` (:func:`train_runs`), then turns their
``metrics.jsonl`` / ``summary.json`` (and any file a callback wrote) into ``OUT/report.md`` and
a PNG figure.

Every run of an analysis starts from the same configuration, so the same seed gives the same
initial weights and the same batches in the same order; only what the run names changes.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fira_train.config.overrides import apply_overrides, flat_config, override_key
from fira_train.config.resolve import resolved
from fira_train.config.recipes import get_recipe
from fira_train.config.run_config import RunConfig
from fira_train.data.build import build_corpus
from fira_train.files import (ANALYSIS_RUN_FILE, DamagedFileError, check_report_owner, cut_back_json_lines, dumps,
                               open_append, read_json, read_json_lines, refuse_links, write_text_atomic)
from fira_train.report.markdown import analysis_heading, refuse_other_commands_output
from fira_train.run.callbacks import TrainCallback
from fira_train.run.isolated import run_isolated_many, with_threads
from fira_train.run.run_dir import check_same_data, continue_refusal, finished_with
from fira_train.run.run_files import previous_run
from fira_train.run.train import train

log = logging.getLogger(__name__)

#: Where the paper's numbers come from: LLaMA 60M (d_model 512, 8 layers; the rank study at
#: d_model 256), C4, 10K steps of 131K tokens (1.3B tokens), T = 200.
PAPER_SCALE = ("LLaMA 60M on C4, 10,000 steps of 512 x 256 tokens (1.3B tokens), T = 200")

PAPER_TOKENS = 10_000 * 512 * 256
RUN_SPEC_FILE = ANALYSIS_RUN_FILE


@dataclass(frozen=True)
class AnalysisRun:
    """One training run of an analysis."""

    name: str
    """Directory name under the analysis folder, and the label in tables and figures."""
    method: str
    """A :mod:`fira_train.methods.registry` name."""
    overrides: tuple[str, ...] = ()
    """``section.field=value`` config overrides applied after the method."""
    callbacks: Callable[[Path], Sequence[TrainCallback]] | None = field(default=None, compare=False)
    """Builds the run's callbacks given its directory (they may write files there)."""
    describe: str = ""
    """What the callbacks change, recorded with the run (``OUT/<name>/analysis_run.json``) so that
    a run is only reused when it was made the same way."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"run name must be a plain directory name, got name={self.name!r}")

    def label(self) -> str:
        """What the run trains, for its progress line: the method, its overrides and what its
        callbacks change (``fira optim.rank=4``, ``adamw; NormRecorder, GradientNoise(...)``)."""
        return " ".join((self.method, *self.overrides)) + (f"; {self.describe}" if self.describe else "")

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "method": self.method, "overrides": list(self.overrides),
                "callbacks": self.describe}


def run_config(config: RunConfig, run: AnalysisRun, out_dir: str | Path) -> RunConfig:
    """``config`` with ``run``'s method and overrides, writing to ``out_dir/run.name``."""
    config = replace(config, optim=replace(config.optim, method=run.method))
    config = apply_overrides(config, list(run.overrides))
    return replace(config, train=replace(config.train, out_dir=str(Path(out_dir) / run.name)))


_REDO_HINT = "delete the run's folder (or pass --overwrite) to train it again"


def _reusable(config: RunConfig, run: AnalysisRun, run_dir: Path) -> bool:
    spec = run_dir / RUN_SPEC_FILE
    return (finished_with(config, run_dir) and spec.exists()
            and read_json(spec, hint=_REDO_HINT) == run.spec())


def _refuse_another_analysis(out_dir: Path, title: str) -> None:
    """FileExistsError where ``out_dir`` holds another analysis's report, --overwrite or not: its
    report.md was replaced and its runs and figure stayed beside this one's, in a folder that was
    neither's (a report.md of the user's is :func:`check_report_owner`'s, which --overwrite
    replaces)."""
    heading = analysis_heading(out_dir)
    if heading and not heading.startswith(f"# {title}"):
        raise FileExistsError(f"--out {str(out_dir)!r} holds another analysis's results ({heading.lstrip('# ')!r}), "
                              "which this analysis's runs and report.md would mix with or replace, --overwrite or "
                              "not: choose a fresh --out")


def train_runs(config: RunConfig, runs: Sequence[AnalysisRun], out_dir: str | Path, *,
               title: str, reuse: bool = False, overwrite: bool = False,
               jobs: int = 1, partly_set: Sequence[str] = (),
               given: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Train ``runs`` on one shared corpus; returns ``{name: summary}``.

    ``title``: the heading of the analysis's report; a ``report.md`` in ``out_dir`` with another
    (the user's, or another command's) is refused unless ``overwrite``.

    A setting the caller gave (``given``: key -> how it was given, e.g. ``{"train.seed": "--seed 0"}``;
    None: what ``config`` changes from its recipe) that a run sets to another value is refused
    (:func:`check_not_replaced`), but for the keys of ``partly_set``: settings some runs set while
    the others take ``config``'s (the spikes analysis's GaLore rank).

    ``reuse``: a run whose folder already holds a finished run of the same config and spec is
    not trained again; a finished run of another config is an error (before anything trains). An
    unfinished run started with the same config and spec continues from its newest checkpoint,
    callbacks' state included (:meth:`~fira_train.run.callbacks.TrainCallback.state_dict`), and
    ends as if it had not stopped; any other unfinished one is deleted and redone from its start.
    ``overwrite``: every
    existing run is deleted and redone. With neither, an existing run is an error
    (:func:`fira_train.run.train.train` refuses to overwrite it).

    ``jobs``: how many runs train at once, each in a worker process of its own (``spawn``, so
    each initializes CUDA for itself). Runs share nothing but the corpus cache on disk, which is
    built here first, so the results do not depend on ``jobs``. A worker whose run sets no
    ``train.num_threads`` gets ``cpu_count // jobs`` torch threads. Useful where one run leaves
    the hardware idle (a GPU that waits on kernel launches, many CPU cores); on 2 cores it only
    splits them. If a run fails, the others still finish (``reuse`` keeps them) before its error is
    raised.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs (--jobs) must be an int >= 1, got jobs={jobs!r}")
    if reuse and overwrite:
        raise ValueError("--reuse keeps finished runs and --overwrite redoes them: pass one of them")
    refuse_links(out_dir)  # a folder from elsewhere: no link sends a write or deletion outside it
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"run name {duplicates[0]!r} appears twice")
    out_dir = Path(out_dir)
    configs = [run_config(config, r, out_dir) for r in runs]  # validates every override first
    check_not_replaced(config, runs, configs, partly_set, given)
    refuse_other_commands_output(out_dir)
    _refuse_another_analysis(out_dir, title)
    check_report_owner(out_dir, (f"# {title}",), "analyze", overwrite=overwrite,
                       writer=f"this analysis ({title!r})")
    if not (reuse or overwrite):
        _check_no_earlier_runs(configs)
    kept = _runs_to_reuse(runs, configs) if reuse else set()  # before the corpus: config alone
    resumed = set()
    for run, cfg in zip(runs, configs):
        if reuse and run.name not in kept:
            refusal = _resume_refusal(cfg, run)
            if refusal is None:
                resumed.add(run.name)
            elif previous_run(Path(cfg.train.out_dir)) and not Path(cfg.train.out_dir, "summary.json").exists():
                # its steps are lost: say so, and why (a finished run without a spec is warned of above)
                log.warning("%s holds an unfinished run that --reuse cannot continue (%s): training it again "
                            "from its start", cfg.train.out_dir, refusal)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(config.data)  # trains and caches the tokenizer once, before any worker
    data = corpus.describe()
    for run, cfg in zip(runs, configs):  # a kept run must have been trained on this corpus
        if run.name in kept:
            run_dir = Path(cfg.train.out_dir)
            check_same_data(run_dir, read_json(run_dir / "summary.json", hint=_REDO_HINT), data)
    summaries: dict[str, dict[str, Any]] = {}
    pending = []
    for index, (run, cfg) in enumerate(zip(runs, configs), start=1):
        run_dir = Path(cfg.train.out_dir)
        if run.name in kept:
            log.info("[%d/%d] %s: finished run reused from %s", index, len(runs), run.name, run_dir)
            summaries[run.name] = read_json(run_dir / "summary.json", hint=_REDO_HINT)
        else:
            pending.append((index, run, cfg))

    def mode(run: AnalysisRun) -> str:
        return "resume" if run.name in resumed else "overwrite" if overwrite or reuse else "new"

    if jobs == 1 or len(pending) <= 1:
        for index, run, cfg in pending:
            summaries[run.name] = _train_one(index, len(runs), run, cfg, mode(run), corpus)
    else:
        workers = min(jobs, len(pending))
        tasks = [(index, len(runs), run, with_threads(cfg, workers), mode(run))
                 for index, run, cfg in pending]
        log.info("training %d runs in %d worker processes", len(tasks), workers)
        # Every run finishes even if one fails (reuse keeps them); then the first error is raised.
        for name, summary in run_isolated_many([(_train_task, (task,)) for task in tasks], workers):
            summaries[name] = summary
    return {name: summaries[name] for name in names}


#: What a run always sets: its method (the analysis's method flags).
_ALWAYS_SET = ("optim.method",)


def check_not_replaced(config: RunConfig, runs: Sequence[AnalysisRun], configs: Sequence[RunConfig],
                       partly_set: Sequence[str] = (), given: Mapping[str, str] | None = None) -> None:
    """ValueError if a setting the caller gave is one a run sets to another value (``optim.rank=8``
    given to a rank sweep, ``--seed 0`` beside ``--seeds 1,2``): it would be silently replaced.

    ``given`` maps each key the caller set to how it was set (the command line's words, shown in
    the error); None takes the settings ``config`` changes from its recipe (nothing for a config
    of no known recipe), which misses a value given equal to the recipe's own. Keys of
    ``partly_set`` are not checked."""
    if given is None:
        given = _changed_from_recipe(config)
    values_given = flat_config(config)
    for run, run_cfg in zip(runs, configs):
        values = flat_config(run_cfg)
        keys = _ALWAYS_SET + tuple(override_key(o) for o in run.overrides)
        for key in keys:
            if key in given and key not in partly_set and values[key] != values_given[key]:
                raise ValueError(f"{given[key]} would be replaced: the analysis sets {key} for each run "
                                 f"(run {run.name!r}: {values[key]!r}); leave it out, and choose it with "
                                 "the analysis's own flags (--help)")


def _changed_from_recipe(config: RunConfig) -> dict[str, str]:
    """``{key: "key=value"}`` for each setting ``config`` changes from its recipe ({} if none is known)."""
    try:
        recipe = flat_config(get_recipe(config.recipe))
    except ValueError:
        return {}
    return {key: f"{key}={value!r}" for key, value in flat_config(config).items() if value != recipe.get(key)}


def refuse_step_in_backward(config: RunConfig, uses: str) -> None:
    """ValueError if the runs update in the backward pass: the analysis ``uses`` each step's
    gradients after the backward pass, and step-in-backward has freed them by then (noise would
    not reach the update, recorded norms would be 0)."""
    if config.optim.step_in_backward:
        raise ValueError(f"this analysis {uses}, which optim.step_in_backward=true frees: leave it off")


def _runs_to_reuse(runs: Sequence[AnalysisRun], configs: Sequence[RunConfig]) -> set[str]:
    """The names of the runs ``--reuse`` keeps: finished with the same config and spec (the
    caller checks their data once the corpus is built). FileExistsError, before anything trains,
    for a finished run it cannot keep: made with another config or spec (``--steps 30`` then
    ``--steps 5 --reuse`` deleted and retrained the 30-step runs without a word). A finished run
    without a spec file (written by a version that wrote it last, and stopped just before) is
    trained again."""
    kept = set()
    for run, cfg in zip(runs, configs):
        run_dir = Path(cfg.train.out_dir)
        if _reusable(cfg, run, run_dir):
            kept.add(run.name)
        elif (run_dir / "summary.json").exists():
            if not (run_dir / RUN_SPEC_FILE).exists():
                log.warning("%s holds a finished run without its %s (a start stopped before writing it, or not "
                            "a run of an analysis): training it again", run_dir, RUN_SPEC_FILE)
                continue
            raise FileExistsError(f"{str(run_dir)!r} holds a finished run made with another config: --reuse keeps "
                                  "only runs of this one; pass --overwrite to train every run again, or choose "
                                  "another --out")
    return kept


def _resume_refusal(config: RunConfig, run: AnalysisRun) -> str | None:
    """Why ``--reuse`` cannot continue the unfinished run in ``config``'s folder from its
    checkpoints; None if it can (:func:`train_runs`): it was started with ``run``'s spec (written
    when a run starts) and this config, up to the keys a resume may change."""
    run_dir = Path(config.train.out_dir)
    spec, saved = run_dir / RUN_SPEC_FILE, run_dir / "config.json"
    if (run_dir / "summary.json").exists():
        return "it is finished"
    if not (spec.is_file() and saved.is_file()):
        return f"it has no {RUN_SPEC_FILE if not spec.is_file() else 'config.json'}"
    try:
        if read_json(spec) != run.spec():
            return f"it was started with other callbacks or overrides ({RUN_SPEC_FILE})"
        refusal = continue_refusal(run_dir, resolved(config))  # what its own resume would refuse
    except ValueError as err:  # DamagedFileError, or a config record this version cannot read
        return f"its records cannot be read: {err}"
    return None if refusal is None else f"it has {refusal}"


class _RecordSpec(TrainCallback):
    """Writes a run's spec file when it starts from step 0: inside :func:`train`'s hold on the
    folder, after an earlier run there was cleared (written before, it could mark that run's
    checkpoints, or a running one's, with this spec)."""

    def __init__(self, run_dir: Path, spec: dict[str, Any]) -> None:
        self.path, self.spec = run_dir / RUN_SPEC_FILE, spec

    def begin(self, step: int) -> None:
        if step == 0:
            write_text_atomic(self.path, json.dumps(self.spec, indent=2) + "\n")


def _check_no_earlier_runs(configs: Sequence[RunConfig]) -> None:
    """FileExistsError naming analyze's own flags if a run's folder already holds a run (before
    anything trains; :func:`fira_train.run.train.train` would name pretrain's --resume)."""
    for cfg in configs:
        run_dir = Path(cfg.train.out_dir)
        previous = previous_run(run_dir)
        if previous:
            raise FileExistsError(f"{str(run_dir)!r} already holds a run ({', '.join(previous)}); pass "
                                  "--reuse to keep the finished runs made with the same config, or "
                                  "--overwrite to train every run again")


def _train_task(task: tuple) -> tuple[str, dict[str, Any]]:
    """A worker's job: the corpus comes from the cache the parent filled."""
    index, total, run, cfg, mode = task
    return run.name, _train_one(index, total, run, cfg, mode, None)


def _train_one(index: int, total: int, run: AnalysisRun, cfg: RunConfig, mode: str,
               corpus: Any) -> dict[str, Any]:
    """Train one run into its folder (building the corpus from the cache if not given). ``mode``:
    ``"new"`` (its folder holds no run), ``"overwrite"`` (a run there is replaced) or
    ``"resume"`` (the unfinished run there continues from its newest checkpoint). A run's spec
    is written as it starts (:class:`_RecordSpec`): an unfinished run is resumed only under its
    own spec."""
    run_dir = Path(cfg.train.out_dir)
    log.info("[%d/%d] %s (%s) -> %s%s", index, total, run.name, run.label(), run_dir,
             ": continuing from its newest checkpoint" if mode == "resume" else "")
    if corpus is None:
        corpus = build_corpus(cfg.data)
    callbacks = [*(run.callbacks(run_dir) if run.callbacks is not None else []), _RecordSpec(run_dir, run.spec())]
    if mode == "resume":
        summary = train(cfg, resume="latest", corpus=corpus, callbacks=callbacks)
    else:
        summary = train(cfg, overwrite=mode == "overwrite", corpus=corpus, callbacks=callbacks)
    log.info("[%d/%d] %s: validation perplexity %.2f", index, total, run.name, summary["val_ppl"])
    return summary


# --------------------------------------------------------------------------- report helpers


def machine_description() -> str:
    """CPU / GPU, core count and library versions, for the report header."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = f"CPU ({platform.machine()}, {os.cpu_count()} logical cores)"
    return f"{device}, torch {torch.__version__}, Python {platform.python_version()}"


def seeds_text(seeds: Sequence[int]) -> str:
    """``seed 0`` or ``seeds 0, 1, 2``."""
    return f"seed {seeds[0]}" if len(seeds) == 1 else "seeds " + ", ".join(map(str, seeds))


def budget_description(config: RunConfig, seeds: Sequence[int] | None = None) -> str:
    """The scale the analysis ran at, in one sentence. ``seeds``: the seeds its runs used, where
    they are not the config's one seed (a sweep over seeds)."""
    t, m, d = config.train, config.model, config.data
    tokens = t.steps * t.batch_size * d.seq_len
    seeds = list(seeds) if seeds else [t.seed]
    return (f"recipe `{config.recipe}`: LLaMA d_model {m.hidden_size}, {m.num_hidden_layers} layers, "
            f"{m.num_attention_heads} heads; {t.steps} steps of {t.batch_size} x {d.seq_len} tokens "
            f"({tokens:,} tokens), data `{d.source}`, {seeds_text(seeds)}, T = {config.optim.update_proj_gap}, "
            f"alpha = {config.optim.alpha}")


def scale_note(config: RunConfig) -> str:
    """How far the budget is from the paper's, in tokens."""
    t = config.train
    tokens = t.steps * t.batch_size * config.data.seq_len
    if tokens >= PAPER_TOKENS:
        return "This budget reaches the paper's number of tokens."
    return (f"This budget is {tokens / PAPER_TOKENS:.1e} of the paper's tokens: the paper's scale was "
            "not reached, and the numbers below are as measured, not tuned.")


def report_header(title: str, config: RunConfig, *, command: str | None, note: str = "",
                  seeds: Sequence[int] | None = None) -> list[str]:
    """Title, date, command, machine and budget lines of a report (``seeds``: see
    :func:`budget_description`)."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# {title}", "", f"- Date: {date}",
             f"- Command: `{command}`" if command else "- Command: (called from Python)",
             f"- Machine: {machine_description()}",
             f"- Budget: {budget_description(config, seeds)}",
             f"- Paper's scale: {PAPER_SCALE}. {scale_note(config)}"]
    if note:
        lines.append(f"- {note}")
    return lines + [""]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats are written with 4 significant digits, trailing zeros kept."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            # "#": 112.0 stays "112.0" beside "110.9" (plain "g" wrote "112", and 299.97 as
            # "300", as if rounded to an integer); a whole 4-digit number loses only its point
            return f"{value:#.4g}".removesuffix(".")
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records a callback wrote to ``path`` (JSON lines) in a finished run's folder; a file
    that is missing or cannot be parsed is named, with what to do (a bare ``json`` error named
    neither the file nor the run). A ``null`` (a value that was not finite, as
    :class:`JsonlWriter` writes it) is read as NaN, so that a record's figures stay numbers."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is missing: the analysis reads what its run recorded there; "
                                f"{_REDO_HINT}")
    records = read_json_lines(path, hint=_REDO_HINT)
    for number, record in enumerate(records, start=1):
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise DamagedFileError(path, f"record {number} is not a step's record", _REDO_HINT)
    return [_nan_for_null(record) for record in records]


def _nan_for_null(value: Any) -> Any:
    """``value`` with every ``None`` (in dicts and lists) replaced by NaN."""
    if value is None:
        return math.nan
    if isinstance(value, dict):
        return {key: _nan_for_null(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_nan_for_null(v) for v in value]
    return value


def read_step_records(path: str | Path, summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The records a per-step callback (:class:`~fira_train.analysis.callbacks.NormRecorder`)
    wrote to ``path`` for the finished run of ``summary``: one for each step that updated the
    weights, steps ``1..S`` (``S = summary["steps"]``) in order, but the ``skipped_steps`` of
    ``train.precision=fp16``. Anything else (a file cut or edited by hand) is
    :class:`~fira_train.files.DamagedFileError`: the report would give the numbers of fewer steps
    (a "final loss" of step 3 of 8) as the run's."""
    records = read_records(path)
    steps = [r["step"] for r in records]
    total = int(summary["steps"])
    expected = total - int(summary.get("skipped_steps") or 0)
    in_order = all(1 <= s <= total for s in steps) and all(a < b for a, b in zip(steps, steps[1:]))
    if not in_order or len(steps) != expected:
        held = f"steps {steps[0]}..{steps[-1]}" if steps else "no step"
        raise DamagedFileError(path, f"{len(steps)} records ({held}) where the finished run updated at "
                                     f"{expected} of its {total} steps", _REDO_HINT)
    return records


class JsonlWriter:
    """Appends one JSON object per line to a file; every object has a ``"step"``. A value that is
    not finite is written as ``null`` (as ``metrics.jsonl`` writes it), never ``NaN`` or
    ``Infinity``, which are not JSON; :func:`read_records` reads it back as NaN.

    The file is started by :meth:`begin` (the callback's :meth:`TrainCallback.begin`, or the first
    :meth:`write`): a new run empties it, a resumed one keeps the lines of the steps up to the
    checkpoint's and drops those a stopped sitting wrote after it, so that the file ends as that
    of a run that never stopped. Nothing is read or emptied before then: building the callbacks
    again to resume leaves the file as it was."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._begun = False

    def begin(self, step: int) -> None:
        """Keep the lines of steps ``<= step`` (none for 0), as ``metrics.jsonl`` is cut back
        (:func:`fira_train.files.cut_back_json_lines`)."""
        if step == 0:
            write_text_atomic(self.path, "")
        elif not self.path.exists():
            raise FileNotFoundError(f"{str(self.path)!r} is missing: the run resumes from step {step}, and "
                                    "what it recorded up to there is lost; start the run again (--overwrite)")
        else:
            cut_back_json_lines(self.path, step, hint=_REDO_HINT)
        self._begun = True

    def write(self, record: dict[str, Any]) -> None:
        if not self._begun:
            self.begin(0)
        with open_append(self.path) as f:  # as metrics.jsonl: never through a link, nor into a FIFO
            f.write(dumps(record) + "\n")  # NaN / inf as null
