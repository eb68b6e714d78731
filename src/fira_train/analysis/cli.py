"""``fira-train analyze``: the paper's analyses as commands.

::

    fira-train analyze similarity [--ranks R,R] [--every N] [--columns 100] [common flags]
    fira-train analyze rank-sweep [--ranks R,R,...] [--methods fira,galore,fira-only-scaling]
    fira-train analyze gap-sweep  [--gaps 3,6,12,25,50] [--methods fira,galore] [--seeds 0,1]
    fira-train analyze ablation   [--variants fira,fira-no-scaling,...] [--gammas inf,1.1,1.01,1.001,1]
    fira-train analyze spikes     [--limiter-runs fira,fira-no-limiter,fira-clip] [--galore-runs galore,galore-add]
    fira-train analyze noise      [--methods fira-only-scaling,adamw] [--scale 1e-5]
    fira-train analyze variance   [--samples N] [--steps N] [--seed S] [--out DIR]

Common flags of the training analyses: ``--recipe`` (default ``tiny``), ``--out DIR`` (default
``runs/analysis/<name>``), ``--steps N``, ``--seed S``, ``--data SOURCE``, ``--reuse`` (keep
finished runs of the same config, continue unfinished ones from their checkpoints), ``--overwrite`` (redo existing runs), ``--jobs N`` (train N
runs at once, in worker processes) and
``section.field=value`` overrides applied to the recipe (e.g. ``train.batch_size=4``; one of a
setting the analysis chooses per run, such as ``optim.rank`` in a rank sweep, is refused: the
analysis's own flag sets it). ``--reuse`` and ``--overwrite`` exclude each other; a list flag with
an empty or repeated entry is refused. The default
ranks follow the recipe's d_model at the paper's ratios r/d_model (16/256, 128/256 for
similarity; 4/256, 16/256, 64/256, 128/256 for rank-sweep: :mod:`fira_train.analysis.rank_defaults`).
Each writes ``OUT/report.md`` and a PNG figure, and one run folder per training run.
"""

from __future__ import annotations

import argparse
import importlib
import math
from pathlib import Path
from typing import Any, Callable

from fira_train.analysis.variance import run_variance_analysis
from fira_train.config.comma_list import comma_list, distinct
from fira_train.report.markdown import command_line
from fira_train.run.launch import refuse_torchrun

ANALYSES = ("similarity", "rank-sweep", "gap-sweep", "ablation", "spikes", "noise", "variance")


def _names(text: str, flag: str) -> list[str]:
    names = comma_list(text, flag)
    for name in names:
        method, at, overrides = name.partition("@")
        if at:  # sweep's and compare's NAME@key=value: read as a name, an "unknown method"
            raise ValueError(f"{flag}: {name!r} is a method spec (NAME@key=value); analyze takes method names: "
                             f"set {' '.join(overrides.split('@'))} for every run as a key=value override "
                             f"(and {method!r} in {flag})")
    from fira_train.methods.registry import METHODS  # imports torch: not at parser build

    unknown = [name for name in names if name not in METHODS]
    if unknown:  # the analysis's own check names the method, not the flag that gave it
        raise ValueError(f"{flag}: unknown method {unknown[0]!r} in {text!r}; valid methods: {', '.join(METHODS)}")
    return names


def _ints(text: str, flag: str) -> list[int]:
    names = comma_list(text, flag)
    try:
        values = [int(n) for n in names]
    except ValueError as err:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from err
    return distinct(values, text, flag)


def _floats(text: str, flag: str) -> list[float]:
    names = comma_list(text, flag)
    try:
        values = [math.inf if n.lower() in ("inf", "infinity") else float(n) for n in names]
    except ValueError as err:
        raise ValueError(f"{flag} must be comma-separated numbers (or inf), got {text!r}") from err
    return distinct(values, text, flag)


def _ranks(args: argparse.Namespace) -> list[int] | None:
    """``--ranks``, or None: the analysis then picks ranks for the recipe's width."""
    return None if args.ranks is None else _ints(args.ranks, "--ranks")


def _command_line(args: argparse.Namespace) -> str:
    return command_line(getattr(args, "argv", []))


def _config(args: argparse.Namespace):
    """The run config, and ``{key: how the command line gave it}`` for each setting it gave (an
    analysis refuses one it would replace in a run, even when equal to the recipe's value)."""
    from fira_train.config.overrides import (  # imports torch: not at parser build
        apply_command_line, flags_given, override_key, refuse_overrides)
    from fira_train.config.recipes import get_recipe

    flags = flags_given(args, {"steps": "train.steps", "seed": "train.seed", "data": "data.source"})
    refuse_overrides(args.overrides, ("train.out_dir",),
                     "an analysis writes each run to OUT/<run>; choose OUT with --out")
    config = apply_command_line(get_recipe(args.recipe), flags, args.overrides)
    given = {key: f"{flag} {value}" for key, (flag, value) in flags.items()}
    given.update({override_key(o): o.strip() for o in args.overrides})
    return config, given


def _run(target: str, **extra: Callable[[argparse.Namespace], Any]):
    """The ``func`` of an analysis sub-command; ``target`` is ``"module:function"``, imported
    only when the command runs (torch stays out of ``fira-train --help``)."""
    module_name, function = target.split(":")

    def command(args: argparse.Namespace) -> int:
        _one_process()
        analysis = getattr(importlib.import_module(module_name), function)
        config, given = _config(args)
        out = _out(args, f"runs/analysis/{args.analysis}")
        options = {key: get(args) for key, get in extra.items()}
        options = {k: v for k, v in options.items() if v is not None}
        result = analysis(config, out, reuse=args.reuse, overwrite=args.overwrite, jobs=args.jobs,
                          command=_command_line(args), given=given, **options)
        print(Path(result["report"]).read_text())
        print(f"report: {result['report']}")
        print(f"figure: {result['figure']}")
        return 0

    return command


def _common(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--recipe", default="tiny", help="recipe (default tiny; micro for a smoke test)")
    parser.add_argument("--out", help=f"output folder (default runs/analysis/{name})")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (train.steps)")
    parser.add_argument("--seed", type=int, help="seed of init, data order and noise (train.seed)")
    parser.add_argument("--data", help="data source (data.source): wiki, c4 or a local path")
    parser.add_argument("--reuse", action="store_true",
                        help="keep finished runs made with the same config on the same data, and continue "
                             "unfinished ones from their newest checkpoints (train.save_every)")
    parser.add_argument("--overwrite", action="store_true", help="delete and redo existing runs")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained at once, one worker process each (default 1; e.g. 4 on a GPU "
                             "that one run leaves waiting on kernel launches)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. train.batch_size=4 model.num_hidden_layers=2")
    parser.set_defaults(analysis=name)


def _one_process() -> None:
    """Refuse a ``torchrun`` launch of several processes: each would write OUT's files over the
    others' (and a training analysis's runs, processes of that launch, would each refuse it with
    a ``--parallel`` that analyze does not take)."""
    refuse_torchrun("analyze runs in one process (its runs each in their own)")


def _out(args: argparse.Namespace, default: str) -> str:
    """``--out``, else ``default``; ValueError for an empty one (it fell back to ``default``)."""
    if args.out == "":
        raise ValueError(f"--out '' names no folder: give a path, or leave --out out for {default}")
    args.run_dir = args.out or default  # the default too: what a stop's message speaks of
    return args.run_dir


def _variance(args: argparse.Namespace) -> int:
    _one_process()
    out = _out(args, "runs/analysis/variance")
    result = run_variance_analysis(out, samples=args.samples, steps=args.steps, seed=args.seed,
                                   command=_command_line(args), machine=_machine())
    print(Path(result["report"]).read_text())
    print(f"report: {result['report']}")
    print(f"figure: {result['figure']}")
    return 0


def _machine() -> str:
    from fira_train.analysis.runs import machine_description  # imports torch: not at parser build

    return machine_description()


def register(subparsers: Any) -> None:
    """Add ``fira-train analyze {similarity,rank-sweep,gap-sweep,ablation,spikes,noise,variance}``."""
    parser = subparsers.add_parser(
        "analyze", help="the paper's analyses (similarity, rank-sweep, gap-sweep, ablation, spikes, noise, variance)",
        description="Train what an analysis of the Fira paper needs and write OUT/report.md and a figure.")
    sub = parser.add_subparsers(dest="analysis_name", required=True, metavar="ANALYSIS")

    p = sub.add_parser("similarity", help="low-rank vs full-rank scaling factors (cosine, MSE, correlations)")
    p.add_argument("--ranks", help="Fira ranks (default r/d_model 16/256 and 128/256 of the recipe's d_model: "
                                    "16,128 for tiny, 4,32 for micro)")
    p.add_argument("--every", type=int, help="record the factors every N steps (default steps // 100)")
    p.add_argument("--columns", type=int, default=100, help="columns sampled per matrix (default 100)")
    _common(p, "similarity")
    p.set_defaults(func=_run("fira_train.analysis.similarity:run_similarity", ranks=_ranks,
                             every=lambda a: a.every, columns=lambda a: a.columns))

    p = sub.add_parser("rank-sweep", help="validation perplexity of Fira / GaLore / Fira-only-scaling vs rank")
    p.add_argument("--ranks", help="ranks (default r/d_model 4/256, 16/256, 64/256, 128/256 of the recipe's "
                                    "d_model: 4,16,64,128 for tiny, 1,4,16,32 for micro)")
    p.add_argument("--methods", default="fira,galore,fira-only-scaling", help="methods swept over the ranks")
    _common(p, "rank-sweep")
    p.set_defaults(func=_run("fira_train.analysis.rank_sweep:run_rank_sweep", ranks=_ranks,
                             methods=lambda a: _names(a.methods, "--methods")))

    p = sub.add_parser("gap-sweep", help="validation perplexity of Fira / GaLore vs the update gap T")
    p.add_argument("--gaps", default="3,6,12,25,50", help="update gaps T (default 3,6,12,25,50)")
    p.add_argument("--methods", default="fira,galore", help="methods swept over the gaps (default fira,galore)")
    p.add_argument("--seeds", help="seeds, each a run per method and gap (default: --seed or the recipe's)")
    _common(p, "gap-sweep")
    p.set_defaults(func=_run("fira_train.analysis.gap_sweep:run_gap_sweep", gaps=lambda a: _ints(a.gaps, "--gaps"),
                             methods=lambda a: _names(a.methods, "--methods"),
                             # "--seeds ''" is refused as an empty list, not taken for no --seeds
                             seeds=lambda a: _ints(a.seeds, "--seeds") if a.seeds is not None else None))

    p = sub.add_parser("ablation", help="scaling / limiter ablations, stabilisers and gamma")
    p.add_argument("--variants", help="ablation methods",
                   default="fira,fira-no-scaling,fira-matrix,fira-no-limiter,fira-clip,fira-shrink,fira-tensorwise")
    p.add_argument("--gammas", default="inf,1.1,1.01,1.001,1", help="limiter gammas (inf: no limiter)")
    _common(p, "ablation")
    p.set_defaults(func=_run("fira_train.analysis.ablation:run_ablation",
                             variants=lambda a: _names(a.variants, "--variants"),
                             gammas=lambda a: _floats(a.gammas, "--gammas")))

    p = sub.add_parser("spikes", help="loss and gradient norm with / without the limiter; GaLore vs GaLore-add")
    p.add_argument("--limiter-runs", default="fira,fira-no-limiter,fira-clip",
                   help="Fira variants of the limiter figure")
    p.add_argument("--galore-runs", default="galore,galore-add", help="runs of the GaLore-add figure")
    p.add_argument("--galore-rank", type=int, default=16,
                   help="rank of the GaLore runs (default 16, not scaled to the recipe: the paper's "
                        "r/d_model = 16/256 at tiny's width, 16/64 on micro)")
    _common(p, "spikes")
    p.set_defaults(func=_run("fira_train.analysis.spikes:run_spikes",
                             limiter_runs=lambda a: _names(a.limiter_runs, "--limiter-runs"),
                             galore_runs=lambda a: _names(a.galore_runs, "--galore-runs"),
                             galore_rank=lambda a: a.galore_rank))

    p = sub.add_parser("noise", help="Fira-only-scaling vs AdamW with and without gradient noise")
    p.add_argument("--methods", default="fira-only-scaling,adamw", help="methods (default fira-only-scaling,adamw)")
    p.add_argument("--scale", type=float, default=1e-5, help="noise scale s in s * N(0, 1) (default 1e-5)")
    _common(p, "noise")
    p.set_defaults(func=_run("fira_train.analysis.noise:run_noise", methods=lambda a: _names(a.methods, "--methods"),
                             scale=lambda a: a.scale))

    p = sub.add_parser("variance", help="Var[phi] simulation across ranks and the Theorem 2 check (no training)")
    p.add_argument("--samples", type=int, default=10_000, help="Monte Carlo samples (default 10000)")
    p.add_argument("--steps", type=int, default=1000, help="simulated Adam steps (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of every draw (default 0)")
    p.add_argument("--out", help="output folder (default runs/analysis/variance)")
    p.set_defaults(func=_variance, analysis="variance")
