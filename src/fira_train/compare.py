"""``fira-train compare``: several methods on the same data, tokens and seed, then a report.

Each method runs :func:`fira_train.run.train.train` with the recipe's config, changing only
``optim.method`` (and the learning rate, which is the recipe's tuned rate for the method, else
the method's default, unless ``--lr`` or ``optim.lr=`` sets one for all, or a spec's
``@optim.lr=`` for one) and writing to ``OUT/<method>/``. The tokenised corpus is built
once and shared. Then ``OUT/report.md`` (:func:`fira_train.report.markdown.write_report`) and
``OUT/loss.png`` (:func:`fira_train.report.plots.plot_curves`) are written and their paths
printed.

``--methods`` takes method specs, ``NAME[@key=value...]``
(:mod:`fira_train.config.method_spec`): ``fira@optim.state_dtype=int8`` is Fira with that
override, in ``OUT/fira@optim.state_dtype=int8/``. In one process, each run executes in a fresh
spawned process (:func:`fira_train.run.isolated.run_isolated`), one after another, so its peak
memory is its own; under ``torchrun`` they run in the launched processes. With ``--resume``,
finished runs with the same config are reused and unfinished ones continue from their latest
checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fira_train.config.method_spec import (SHARED, parse_method_spec, parse_method_specs, refuse_same_runs,
                                          refuse_spec_keys)
from fira_train.config.resolve import resolved
from fira_train.config.run_config import RunConfig
from fira_train.data.build import build_corpus
from fira_train.files import check_report_owner, refuse_links
from fira_train.report.markdown import REPORT_TITLE, refuse_other_commands_output, write_report
from fira_train.report.plots import plot_curves
from fira_train.run.isolated import run_isolated
from fira_train.run.launch import before_the_run, same_on_every_rank
from fira_train.run.run_dir import continue_refusal, finished_with
from fira_train.run.train import train
from fira_train.run.train_parallel import check_launch, distributed_session

log = logging.getLogger(__name__)


def parse_methods(text: str) -> list[str]:
    """``"fira,galore@optim.rank=16,adamw"`` -> the method specs as written, each checked
    (names against the registry: ValueError listing them; overrides as ``key=value``)."""
    return [spec.text for spec in parse_method_specs(text)]


def method_config(config: RunConfig, method: str, out_dir: str | Path) -> RunConfig:
    """``config`` for one method spec of the comparison, writing to ``out_dir/<spec>``."""
    return parse_method_spec(method).config(config, out_dir)


def compare(config: RunConfig, methods: list[str], out_dir: str | Path, *, resume: bool = False,
            overwrite: bool = False, command: str | None = None) -> tuple[Path, Path]:
    """Train every method of ``methods`` on ``config`` and write the report; (report, plot) paths.

    With ``train.parallel`` ddp / fsdp2 (under ``torchrun``) every rank trains every method and
    rank 0 writes the report.
    """
    out_dir = Path(out_dir)
    refuse_links(out_dir)
    with same_on_every_rank():  # the command line's specs alone: under torchrun every process refuses them alike
        refuse_spec_keys([parse_method_spec(m) for m in methods], SHARED,
                         "compare trains every method on the same data, tokens and seed (its report says so); "
                         "set it for all of them with key=value")
        configs = [method_config(config, m, out_dir) for m in methods]  # validates every name first
        for method, run_config in zip(methods, configs):  # and the launch each run needs, before the first trains
            try:
                check_launch(run_config)
            except ValueError as err:
                if parse_method_spec(method).setting("train.parallel") is None:
                    raise
                # the spec's own train.parallel, not the command line's --parallel, is the one refused
                raise ValueError(f"method spec {method!r}: {err}") from None
        refuse_same_runs([parse_method_spec(m) for m in methods], config)
    # a sweep's or an analysis's folder: --overwrite replaced its report and put the comparison's
    # runs beside (or over) its own
    refuse_other_commands_output(out_dir, own=REPORT_TITLE, writer="a comparison's", analyses=True)
    check_report_owner(out_dir, (REPORT_TITLE,), "compare", overwrite=overwrite)
    parallel = [c for c in configs if c.train.parallel != "none"]  # --parallel, or a spec's own
    if parallel:
        # One process group for all the runs (each train() then reuses it); rank 0 reports. A
        # group that each run made and left (a spec's own train.parallel) could not be made again.
        with distributed_session(parallel[0]) as env:
            _train_all(config, methods, configs, out_dir, resume, overwrite, isolated=False)
            if not env.is_main:
                return out_dir / "report.md", out_dir / "loss.png"
            return write_report(out_dir, methods, command=command), plot_curves(out_dir, methods)
    _train_all(config, methods, configs, out_dir, resume, overwrite, isolated=True)
    report = write_report(out_dir, methods, command=command)
    plot = plot_curves(out_dir, methods)
    return report, plot


def _check_resumable(todo: list[tuple[str, RunConfig]]) -> None:
    """With ``--resume``: a ValueError naming every method to train whose folder holds a run it
    cannot continue (:func:`~fira_train.run.run_dir.continue_refusal`), before any trains; each
    run refused it itself, but only after the methods before it had trained."""
    with same_on_every_rank():  # the same files for every process of a launch
        refused = [f"{method} ({run_config.train.out_dir}) has {refusal}" for method, run_config in todo
                   if (refusal := continue_refusal(Path(run_config.train.out_dir), resolved(run_config)))]
        if refused:
            raise ValueError(f"--resume: no method was trained: {'; '.join(refused)}. Resume with the settings "
                             "the runs were made with, or train every method again (--overwrite, or another --out)")


def _train_all(config: RunConfig, methods: list[str], configs: list[RunConfig], out_dir: Path,
               resume: bool, overwrite: bool, isolated: bool) -> None:
    """Train the methods one after another on one shared corpus; each in a fresh process where
    ``isolated`` (no process group)."""
    # first: a missing or too small corpus makes no folder; OUT inside the corpus is not read
    with before_the_run(not resume):  # a failure's hint does not offer --resume for OUT's earlier runs
        corpus = build_corpus(config.data, exclude=(out_dir,))
    out_dir.mkdir(parents=True, exist_ok=True)
    finished = [resume and finished_with(c, Path(c.train.out_dir), corpus.describe()) for c in configs]
    if resume:
        _check_resumable([(m, c) for m, c, done in zip(methods, configs, finished) if not done])
    for index, (method, run_config, done) in enumerate(zip(methods, configs, finished), start=1):
        run_dir = Path(run_config.train.out_dir)
        if done:
            log.info("[%d/%d] %s: finished run found in %s, reused", index, len(methods), method, run_dir)
            continue
        log.info("[%d/%d] %s -> %s", index, len(methods), method, run_dir)
        request = "latest" if resume else None
        if isolated:  # a fresh process: the run's peak memory is its own
            summary = run_isolated(train, run_config, resume=request, overwrite=overwrite)
        else:
            summary = train(run_config, resume=request, overwrite=overwrite, corpus=corpus)
        log.info("[%d/%d] %s: validation perplexity %.2f, %.0f tokens/s", index, len(methods), method,
                 summary["val_ppl"], summary["tokens_per_s"])
