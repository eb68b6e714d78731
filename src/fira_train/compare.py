"""``fira-train compare``: several methods on the same data, tokens and seed, then a report.

Each method runs :func:`fira_train.run.train.train` with the recipe's config, changing only
``optim.method`` (and the learning rate, which is each method's default unless ``--lr`` or
``optim.lr=`` sets one for all) and writing to ``OUT/<method>/``. The tokenised corpus is built
once and shared. Then ``OUT/report.md`` (:func:`fira_train.report.markdown.write_report`) and
``OUT/loss.png`` (:func:`fira_train.report.plots.plot_curves`) are written and their paths
printed.

Runs execute one after another in this process; peak memory is reset between them
(:class:`fira_train.run.peak_memory.PeakMemory`). With ``--resume``, finished runs with the same
config are reused and unfinished ones continue from their latest checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from fira_train.config.run_config import RunConfig
from fira_train.data.build import build_corpus
from fira_train.methods.registry import get_method
from fira_train.report.markdown import write_report
from fira_train.report.plots import plot_curves
from fira_train.run.run_dir import finished_with
from fira_train.run.train import train
from fira_train.run.train_parallel import distributed_session

log = logging.getLogger(__name__)


def parse_methods(text: str) -> list[str]:
    """``"fira,galore,adamw"`` -> names, checked against the registry (ValueError listing them)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--methods must name at least one method, got {text!r}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--methods names {duplicates[0]!r} twice")
    for name in names:
        get_method(name)
    return names


def method_config(config: RunConfig, method: str, out_dir: str | Path) -> RunConfig:
    """``config`` for one method of the comparison, writing to ``out_dir/method``."""
    return replace(config, optim=replace(config.optim, method=method),
                   train=replace(config.train, out_dir=str(Path(out_dir) / method)))


def compare(config: RunConfig, methods: list[str], out_dir: str | Path, *, resume: bool = False,
            overwrite: bool = False, command: str | None = None) -> tuple[Path, Path]:
    """Train every method of ``methods`` on ``config`` and write the report; (report, plot) paths.

    With ``train.parallel`` ddp / fsdp2 (under ``torchrun``) every rank trains every method and
    rank 0 writes the report.
    """
    out_dir = Path(out_dir)
    configs = [method_config(config, m, out_dir) for m in methods]  # validates every name first
    if config.train.parallel != "none":
        # One process group for all the runs (each train() then reuses it); rank 0 reports.
        with distributed_session(config) as env:
            _train_all(config, methods, configs, out_dir, resume, overwrite)
            if not env.is_main:
                return out_dir / "report.md", out_dir / "loss.png"
            return write_report(out_dir, methods, command=command), plot_curves(out_dir, methods)
    _train_all(config, methods, configs, out_dir, resume, overwrite)
    report = write_report(out_dir, methods, command=command)
    plot = plot_curves(out_dir, methods)
    return report, plot


def _train_all(config: RunConfig, methods: list[str], configs: list[RunConfig], out_dir: Path,
               resume: bool, overwrite: bool) -> None:
    """Train the methods one after another on one shared corpus."""
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(config.data)
    for index, (method, run_config) in enumerate(zip(methods, configs), start=1):
        run_dir = Path(run_config.train.out_dir)
        if resume and finished_with(run_config, run_dir):
            log.info("[%d/%d] %s: finished run found in %s, reused", index, len(methods), method, run_dir)
            continue
        log.info("[%d/%d] %s -> %s", index, len(methods), method, run_dir)
        summary = train(run_config, resume="latest" if resume else None, overwrite=overwrite, corpus=corpus)
        log.info("[%d/%d] %s: validation perplexity %.2f, %.0f tokens/s", index, len(methods), method,
                 summary["val_ppl"], summary["tokens_per_s"])
