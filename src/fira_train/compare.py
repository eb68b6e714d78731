"""``fira-train compare``: several methods on the same data, tokens and seed, then a report.

Each method runs :func:`fira_train.train.train` with the recipe's config, changing only
``optim.method`` (and the learning rate, which is each method's default unless ``--lr`` or
``optim.lr=`` sets one for all) and writing to ``OUT/<method>/``. The tokenised corpus is built
once and shared. Then ``OUT/report.md`` (:func:`fira_train.report.write_report`) and
``OUT/loss.png`` (:func:`fira_train.report.plot_curves`) are written and their paths printed.

Runs execute one after another in this process; peak memory is reset between them
(:class:`fira_train.metrics.PeakMemory`). With ``--resume``, finished runs with the same config
are reused and unfinished ones continue from their latest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config pulls in torch; ``fira-train --help`` should not
    from fira_train.config import RunConfig

log = logging.getLogger(__name__)


def parse_methods(text: str) -> list[str]:
    """``"fira,galore,adamw"`` -> names, checked against the registry (ValueError listing them)."""
    from fira_train.methods import get_method

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--methods must name at least one method, got {text!r}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--methods names {duplicates[0]!r} twice")
    for name in names:
        get_method(name)
    return names


def method_config(config: "RunConfig", method: str, out_dir: str | Path) -> RunConfig:
    """``config`` for one method of the comparison, writing to ``out_dir/method``."""
    return replace(config, optim=replace(config.optim, method=method),
                   train=replace(config.train, out_dir=str(Path(out_dir) / method)))


def _finished_with(config: "RunConfig", run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a finished run of ``config`` (learning rate resolved): equal up
    to the keys that do not change the weights' trajectory (``train.RESUMABLE_CHANGES``)."""
    from fira_train.json_files import read_json
    from fira_train.overrides import config_from_dict
    from fira_train.methods import resolved_lr
    from fira_train.train import config_changes

    if not (run_dir / "summary.json").exists() or not (run_dir / "config.json").exists():
        return False
    saved = config_from_dict(read_json(run_dir / "config.json", hint="restore it, or delete the run's folder "
                                       "to train it again"))
    wanted = replace(config, optim=replace(config.optim, lr=resolved_lr(config)))
    return not config_changes(saved, wanted)


def compare(config: "RunConfig", methods: list[str], out_dir: str | Path, *, resume: bool = False,
            overwrite: bool = False, command: str | None = None) -> tuple[Path, Path]:
    """Train every method of ``methods`` on ``config`` and write the report; (report, plot) paths.

    With ``train.parallel`` ddp / fsdp2 (under ``torchrun``) every rank trains every method and
    rank 0 writes the report.
    """
    from fira_train.report import plot_curves, write_report

    out_dir = Path(out_dir)
    configs = [method_config(config, m, out_dir) for m in methods]  # validates every name first
    if config.train.parallel != "none":
        from fira_train.train_parallel import distributed_session

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


def _train_all(config: "RunConfig", methods: list[str], configs: list["RunConfig"], out_dir: Path,
               resume: bool, overwrite: bool) -> None:
    """Train the methods one after another on one shared corpus."""
    from fira_train.data import build_corpus
    from fira_train.train import train

    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(config.data)
    for index, (method, run_config) in enumerate(zip(methods, configs), start=1):
        run_dir = Path(run_config.train.out_dir)
        if resume and _finished_with(run_config, run_dir):
            log.info("[%d/%d] %s: finished run found in %s, reused", index, len(methods), method, run_dir)
            continue
        log.info("[%d/%d] %s -> %s", index, len(methods), method, run_dir)
        summary = train(run_config, resume="latest" if resume else None, overwrite=overwrite, corpus=corpus)
        log.info("[%d/%d] %s: validation perplexity %.2f, %.0f tokens/s", index, len(methods), method,
                 summary["val_ppl"], summary["tokens_per_s"])


def _compare_command(args: argparse.Namespace) -> int:
    from fira_train.cli import config_from_args
    from fira_train.report import load_run, report_table

    methods = parse_methods(args.methods)
    config = config_from_args(args)
    out_dir = args.out or f"runs/{config.recipe}-compare"
    command = "fira-train " + " ".join(shlex.quote(a) for a in getattr(args, "argv", []))
    report, plot = compare(config, methods, out_dir, resume=args.resume,
                           overwrite=args.overwrite, command=command)
    from fira_train.cli import is_rank_zero

    if not is_rank_zero():
        return 0
    print(report_table([load_run(Path(out_dir) / m)[0] for m in methods]))
    print(f"report: {report}")
    print(f"plot:   {plot}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``fira-train compare``."""
    from fira_train.cli import add_run_arguments

    parser = subparsers.add_parser(
        "compare", help="pre-train several methods on the same data and write a report",
        description="Run several methods on the same data, tokens and seed, one after another, "
                    "into OUT/<method>/, then write OUT/report.md and OUT/loss.png.")
    parser.add_argument("--methods", required=True, help="comma-separated method names, e.g. fira,galore,adamw")
    parser.add_argument("--out", help="output directory (default: runs/<recipe>-compare)")
    add_run_arguments(parser)
    parser.set_defaults(func=_compare_command)
