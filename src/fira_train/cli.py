"""``fira-train``: the command line (``python -m fira_train`` is the same).

Subcommands (stable names):

- ``fira-train pretrain --recipe NAME --method NAME [--data wiki|c4|PATH] [--steps N] [--out DIR]
  [--resume | --resume-step STEP] [key=value ...]``: one run;
- ``fira-train compare --recipe NAME --methods a,b,c [--out DIR] ...``: several runs on the same
  data, tokens and seed, then ``DIR/report.md`` and ``DIR/loss.png`` (:mod:`fira_train.compare`);
- ``fira-train sweep --recipe NAME --methods SPEC,... --lrs LR,... [--lrs SPEC:LR,...] --seeds 0,1,2
  [--jobs N] [--reuse] --out DIR``: learning rates chosen on validation, test perplexity over
  seeds with paired 95% intervals; ``DIR/report.md``, ``DIR/sweep.json``, ``DIR/lr.png``
  (:mod:`fira_train.sweep.driver`);
- ``fira-train memory``: the paper's memory-estimate table (:mod:`fira_train.memory.estimates`) and
  the run estimate (:func:`fira_train.measure.estimate_rows`), or measured peaks (``--measure``);
- ``fira-train methods``: the method registry with default learning rates;
- ``fira-train finetune`` and ``fira-train analyze ...``: plug-ins (:data:`PLUGINS`), modules
  that expose ``register(subparsers)``, which adds their parser and sets ``func``.

Building the parser imports no torch, so ``--help`` answers at once: each command imports what
it runs when it runs (the imports inside the command functions below).

Flags map onto config keys and are applied after the recipe, then the
``section.field=value`` overrides (which win; anywhere among the flags): ``--data`` -> ``data.source``, ``--steps`` ->
``train.steps``, ``--out`` -> ``train.out_dir``, ``--rank`` -> ``optim.rank``,
``--update-proj-gap`` -> ``optim.update_proj_gap``, ``--lr`` -> ``optim.lr``, ``--seed`` ->
``train.seed``, ``--save-every`` -> ``train.save_every``, ``--eval-every`` -> ``train.eval_every``,
``--parallel`` -> ``train.parallel`` (``none``, ``ddp`` or ``fsdp2``; launch several processes
with ``torchrun --nproc_per_node N -m fira_train pretrain ... --parallel ddp``).

An error that users cause (a bad value, a full disk, a folder that cannot be written, a run that
diverged, ...) is one line on stderr and exit status 1 (:mod:`fira_train.user_errors`). Under
``torchrun``, an error of the command line itself (argparse's, a bad ``key=value``, an unknown
recipe or method, a setting the method or the number of processes refuses:
:func:`same_on_every_rank`), which every process raises alike, is printed by rank 0 alone; the
others print nothing and exit with the same status (under torchrun they wait for it to end them
once rank 0 has exited: :func:`_rank_zero_says_it`). So are the warnings of the command line and
its config (a setting no chosen method reads, a rank above every matrix's size).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import select
import signal
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fira_train.cli_args import IntermixedArgumentParser, StoreOnce
from fira_train.files import measure_out_dir
from fira_train.memory.estimates import format_memory_table, memory_table
from fira_train.report.markdown import command_line, format_bytes, load_run, report_table
from fira_train.run.launch import (BEFORE_THE_RUN, SAME_ON_EVERY_RANK, is_rank_zero, launched_world_size,
                                   same_on_every_rank)
from fira_train.run.process_logging import configure_logging, one_line_warnings
from fira_train.user_errors import (CONTINUES_WITH, before_the_run, describe, finetune_checkpoints, keeps_nothing,
                                    no_checkpoint_yet, nothing_written, out_not_there)

PROG = "fira-train"

log = logging.getLogger(__name__)

#: flag dest -> config key
FLAG_KEYS = {
    "data": "data.source",
    "steps": "train.steps",
    "out": "train.out_dir",
    "rank": "optim.rank",
    "update_proj_gap": "optim.update_proj_gap",
    "lr": "optim.lr",
    "seed": "train.seed",
    "save_every": "train.save_every",
    "eval_every": "train.eval_every",
    "parallel": "train.parallel",
}

#: ``fira-train sweep``'s default ``--seeds``.
SWEEP_SEEDS = "0,1,2"

#: Subcommand modules registered after the built-in ones (skipped if not installed).
PLUGINS = ("fira_train.finetune.cli", "fira_train.analysis.cli")


def add_run_arguments(parser: argparse.ArgumentParser, recipe_required: bool = True, command: str = "pretrain",
                      hidden: Sequence[str] = ()) -> None:
    """The flags shared by ``pretrain``, ``compare`` and ``sweep`` (whose ``--report-only`` needs no
    recipe: it checks ``--recipe`` itself). ``hidden``: flags (dests) the command refuses, parsed
    so that it can say why, but left out of its ``--help``."""

    def add(*names: str, **options: Any) -> None:
        if names[0].lstrip("-").replace("-", "_") in hidden:
            options["help"] = argparse.SUPPRESS
        parser.add_argument(*names, **options)

    add("--recipe", required=recipe_required,
        help="60m, 130m, 350m, 1b, 7b (the paper's LLaMA models), tiny (CPU, ~10 min "
             "per method) or micro (under a minute, for tests)")
    add("--data", help="wiki (the embedded Wikipedia corpus, default), c4 (streams "
                       "allenai/c4, online), c4:DIR (a local copy in C4's layout), or a local "
                       ".txt / .json / .jsonl (optionally .gz) / .npy file or a folder of them")
    add("--steps", type=int, help="optimizer steps (train.steps)")
    add("--rank", type=int, help="projection / LoRA rank (optim.rank)")
    add("--update-proj-gap", type=int, help="subspace update gap T (optim.update_proj_gap)")
    add("--lr", type=float, help="peak learning rate (optim.lr; default: the recipe's tuned "
                                 "rate for the method, else the method's; fira-train methods)")
    add("--seed", type=int, help="seed of init, data order and RNGs (train.seed)")
    add("--save-every", type=int, metavar="N", help="checkpoint every N steps (train.save_every)")
    add("--eval-every", type=int, metavar="N", help="validate every N steps (train.eval_every)")
    add("--parallel", choices=("none", "ddp", "fsdp2"),
        help="data parallelism over the processes of a torchrun launch "
             "(train.parallel; default none): torchrun --nproc_per_node N -m "
             f"fira_train {command} ... --parallel ddp|fsdp2")
    add("--resume", action="store_true",
        help="continue from the newest complete checkpoint in the output directory "
             "(from step 0 if there is none)")
    add("--overwrite", action="store_true",
        help="delete a previous run in the output directory and start over")
    add("overrides", nargs="*", metavar="key=value",
        help="config overrides, e.g. train.batch_size=32 optim.alpha=0.5 "
             "model.num_hidden_layers=2 (sections: model, optim, data, train)")


@same_on_every_rank()
def config_from_args(args: argparse.Namespace):
    """The recipe, then the flags (``--method`` -> ``optim.method`` too), then the overrides."""
    from fira_train.config.overrides import apply_command_line, flags_given  # imports torch
    from fira_train.config.recipes import get_recipe

    given = flags_given(args, FLAG_KEYS)
    if getattr(args, "method", None) is not None:
        given["optim.method"] = ("--method", args.method)
    return apply_command_line(get_recipe(args.recipe), given, args.overrides)


@same_on_every_rank()
def resume_request(args: argparse.Namespace) -> str | int | None:
    """``train``'s ``resume`` argument from ``--resume`` / ``--resume-step``."""
    resuming = args.resume or getattr(args, "resume_step", None) is not None
    if resuming and args.overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite starts a new one there: "
                         "give one of them")
    if getattr(args, "resume_step", None) is not None:
        if args.resume_step < 0:
            raise ValueError(f"--resume-step must be >= 0, got {args.resume_step}")
        return args.resume_step
    return "latest" if args.resume else None


def warn_unused_settings(args: argparse.Namespace, specs: Sequence[str]) -> None:
    """A warning for each ``optim`` setting given (flag, override or a method spec's own) to
    methods none of which reads it (``--method adamw --rank 8``, ``galore@optim.gamma=1.05``):
    trained without it (:attr:`fira_train.methods.method.Method.uses`). Under ``torchrun``,
    rank 0 alone warns, once for the launch."""
    if _another_rank():  # every process is given the same command line: the same warnings
        return
    from fira_train.config.method_spec import parse_method_spec  # imports torch: not at parser build
    from fira_train.config.overrides import flags_given, override_key, override_keys
    from fira_train.methods.registry import get_method

    parsed = [parse_method_spec(spec) for spec in specs]
    names = list(dict.fromkeys(spec.name for spec in parsed))
    known = set(override_keys())  # an unknown key is the error the config build raises, not a warning too

    def unused(key: str, methods: Sequence[str]) -> bool:
        return key in known and not any(get_method(name).reads(key) for name in methods)

    given = dict.fromkeys([*flags_given(args, FLAG_KEYS), *(override_key(item) for item in args.overrides)])
    warning = f"{PROG} {args.command}: warning:"  # as the command's other warnings begin (one_line_warnings)
    for key in given:
        if unused(key, names):
            log.warning("%s %s is not used by %s: it has no effect on %s", warning, key, ", ".join(names),
                        "this run" if len(parsed) == 1 else "these runs")
    for spec in parsed:
        for key in (override_key(item) for item in spec.overrides):
            if unused(key, [spec.name]):
                log.warning("%s %s is not used by %s: it has no effect on the run %s", warning, key, spec.name,
                            spec.text)


def _pretrain(args: argparse.Namespace) -> int:
    from fira_train.run.train import train  # imports torch: not at parser build

    config = config_from_args(args)
    args.run_dir = config.train.out_dir  # the recipe's default too: what a stop's message speaks of
    warn_unused_settings(args, [config.optim.method])
    summary = train(config, resume=resume_request(args), overwrite=args.overwrite)
    out = config.train.out_dir
    if not is_rank_zero():
        return 0
    print(f"{summary['method']}: validation perplexity {summary['val_ppl']:.2f} (loss "
          f"{summary['val_loss']:.4f}) after {summary['steps']} steps, {summary['tokens']:,} tokens")
    print(f"throughput {summary['tokens_per_s']:,.0f} tokens/s; optimizer state "
          f"{summary['optimizer_state_numel']:,} elements ({format_bytes(summary['optimizer_state_bytes'])} "
          f"with step counters); peak memory {format_bytes(summary['peak_memory_bytes'])}")
    print(f"run directory: {out} (config.json, metrics.jsonl, summary.json, tb/, checkpoints/)")
    return 0


def _register_pretrain(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pretrain", help="pre-train a LLaMA model with one method",
        description="Pre-train a randomly initialised LLaMA with one method; writes OUT/config.json, "
                    "OUT/metrics.jsonl, OUT/summary.json, OUT/tb/ and OUT/checkpoints/.")
    parser.add_argument("--method", required=True,
                        help="training method (fira, galore, adamw, lora, relora, ...; "
                             "`fira-train methods` lists them all)")
    parser.add_argument("--out", help="run directory (train.out_dir; default: the recipe's, e.g. runs/tiny)")
    parser.add_argument("--resume-step", type=int, metavar="STEP",
                        help="continue from the checkpoint of step STEP (an error if it is missing)")
    add_run_arguments(parser)
    parser.set_defaults(func=_pretrain)


def _compare(args: argparse.Namespace) -> int:
    from fira_train.compare import compare, parse_methods  # imports torch: not at parser build
    from fira_train.config.method_spec import refuse_set_per_spec

    with same_on_every_rank():
        refuse_set_per_spec(args.overrides, "compare")
        methods = parse_methods(args.methods)
    config = config_from_args(args)
    warn_unused_settings(args, methods)
    out_dir = args.run_dir = args.out or f"runs/{config.recipe}-compare"
    command = command_line(getattr(args, "argv", []))
    report, plot = compare(config, methods, out_dir, resume=resume_request(args) is not None,
                           overwrite=args.overwrite, command=command)
    if not is_rank_zero():
        return 0
    print(report_table([load_run(Path(out_dir) / m)[0] for m in methods], methods))
    print(f"report: {report}")
    print(f"plot:   {plot}")
    return 0


def _register_compare(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "compare", help="pre-train several methods on the same data and write a report",
        description="Run several methods on the same data, tokens and seed, one after another, "
                    "into OUT/<method>/, then write OUT/report.md and OUT/loss.png.")
    parser.add_argument("--methods", required=True, action=StoreOnce,
                        help="comma-separated method specs NAME[@key=value...], e.g. fira,galore@optim.rank=16,adamw")
    parser.add_argument("--out", help="output directory (default: runs/<recipe>-compare)")
    add_run_arguments(parser, command="compare")
    parser.set_defaults(func=_compare)


def _sweep(args: argparse.Namespace) -> int:
    from fira_train.compare import parse_methods  # imports torch: not at parser build
    from fira_train.config.overrides import flags_given, refuse_overrides
    from fira_train.sweep.driver import SWEEP_SETS, parse_lr_grids, parse_numbers, rewrite_report, sweep

    if args.report_only:
        run_flags = [(flag, True) for key, (flag, _) in flags_given(args, FLAG_KEYS).items() if key != "train.out_dir"]
        given = [flag for flag, value in (
            ("--methods", args.methods), ("--lrs", args.lrs), ("--recipe", args.recipe), ("--reuse", args.reuse),
            ("--reference", args.reference), ("--all-seeds", args.all_seeds), ("--jobs", args.jobs != 1),
            ("--seeds", args.seeds != SWEEP_SEEDS), *run_flags, ("--resume", args.resume),
            ("--overwrite", args.overwrite), ("key=value", args.overrides)) if value]
        if given:
            raise ValueError(f"--report-only rebuilds the report from OUT/sweep.json and takes only --out, "
                             f"not {', '.join(given)}")
        report, _ = rewrite_report(args.out)
        print(report.read_text())
        print(f"report: {report}")
        return 0
    missing = [flag for flag, value in (("--recipe", args.recipe), ("--methods", args.methods), ("--lrs", args.lrs))
               if not value]
    if missing:
        raise ValueError(f"sweep needs {' and '.join(missing)} (with --recipe, --methods and --lrs it trains; "
                         "--report-only rebuilds a finished sweep's report)")
    if args.lr is not None or args.seed is not None:
        raise ValueError("sweep sets the learning rate and the seed itself: use --lrs and --seeds, "
                         "not --lr / --seed")
    if args.resume or args.overwrite:
        raise ValueError(f"sweep takes --reuse to continue where it stopped, not "
                         f"{'--resume' if args.resume else '--overwrite'} (choose another --out to start over)")
    refuse_overrides(args.overrides, SWEEP_SETS, "sweep sets it itself (--methods, --lrs, --seeds, --out)")
    specs = parse_methods(args.methods)
    grids = parse_lr_grids(args.lrs, specs)
    seeds = parse_numbers("--seeds", args.seeds, int)
    config = config_from_args(args)
    warn_unused_settings(args, specs)
    report, _ = sweep(config, specs, grids, seeds, args.out, jobs=args.jobs, reuse=args.reuse,
                      all_seeds=args.all_seeds, reference=args.reference,
                      command=command_line(getattr(args, "argv", [])))
    print(report.read_text())
    print(f"report: {report}")
    return 0


def _register_sweep(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sweep", help="tune each method's learning rate on validation; test perplexity over seeds",
        description="Train every method at every learning rate of its grid (first seed), choose each "
                    "method's lr on the validation set, train the other seeds at it, and report test "
                    "perplexity (mean ± sd over seeds) with each method's paired difference to the "
                    "reference and its 95% interval: OUT/report.md, OUT/sweep.json, OUT/lr.png. Runs "
                    "live in OUT/<spec>/lr=<lr>/seed=<seed>/; with --reuse a sweep continues "
                    "where it stopped.")
    parser.add_argument("--methods", action=StoreOnce,
                        help="comma-separated method specs NAME[@key=value...], e.g. "
                             "adamw,fira,adamw-grouped@optim.alpha=1 (required)")
    parser.add_argument("--lrs", action="append", metavar="[SPEC:]LR,...",
                        help="learning-rate grid, e.g. 0.001,0.003,0.01; repeat with SPEC:LR,... to give a "
                             "method its own grid, e.g. --lrs adamw:0.001,0.003,0.01,0.03 (required)")
    parser.add_argument("--seeds", default=SWEEP_SEEDS, help=f"seeds (default {SWEEP_SEEDS}); the grid runs at the first")
    parser.add_argument("--all-seeds", action="store_true",
                        help="run every seed at every lr (choose on the mean over seeds)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time, each in its own process (default 1; on a CPU each gets "
                             "cores/jobs threads)")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse finished runs in OUT and continue unfinished ones from their checkpoints "
                             "(a run folder made with another config, or on data that changed since, is an "
                             "error, not redone)")
    parser.add_argument("--reference", help="the method the others are compared with (default fira, "
                                            "else the first)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: write OUT/report.md, OUT/sweep.json and OUT/lr.png again from "
                             "OUT/sweep.json (a finished sweep in the current report format)")
    parser.add_argument("--out", required=True, help="output directory")
    # parsed, so that sweep can say what to use instead, but not offered
    add_run_arguments(parser, recipe_required=False, command="sweep",
                      hidden=("lr", "seed", "parallel", "resume", "overwrite"))
    parser.set_defaults(func=_sweep)


def _memory(args: argparse.Namespace) -> int:
    if not args.measure:
        if args.overrides or args.append or args.out or args.steps is not None:
            raise ValueError("--steps, --out, --append and key=value overrides go with --measure (without it, "
                             "memory prints estimates; --recipe and --methods choose the run estimate's rows)")
        from fira_train.measure import ESTIMATE_SIZES, ESTIMATE_SPECS, estimate_rows, format_estimate_rows

        if args.methods:  # as --measure warns: the estimate of such a spec is the spec's without it
            from fira_train.config.method_spec import parse_method_specs

            warn_unused_settings(args, [spec.text for spec in parse_method_specs(args.methods)])
        if args.recipe or args.methods:  # the estimate of these specs and sizes only: not the paper's table
            print(format_estimate_rows(estimate_rows((args.recipe,) if args.recipe else ESTIMATE_SIZES,
                                                     (args.methods,) if args.methods else ESTIMATE_SPECS)))
            return 0
        # said, as the second table's line says its own: their totals differ several times over
        print("The paper's memory estimate (Table 2, appendix C.1): weights + gradients + optimizer states, "
              "every element in BF16, no activations; elements in millions (M), totals in GB (10^9 bytes) and "
              "GiB beside the paper's (docs/results/memory.md)")
        print()
        print(format_memory_table(memory_table()))
        print()
        print(format_estimate_rows(estimate_rows()))
        return 0
    from fira_train.config.method_spec import parse_method_specs, refuse_set_per_spec  # imports torch
    from fira_train.measure import measure

    if not args.recipe or not args.methods:
        raise ValueError("memory --measure needs --recipe NAME and --methods SPEC,...")
    steps = 3 if args.steps is None else args.steps
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    from fira_train.config.overrides import refuse_overrides  # imports torch: not at parser build

    refuse_overrides(args.overrides, ("train.steps",), "memory --measure trains --steps steps")
    refuse_overrides(args.overrides, ("train.parallel",), "memory --measure measures each method in one process")
    refuse_set_per_spec(args.overrides, "memory --measure")
    specs = parse_method_specs(args.methods)
    config = config_from_args(args)
    warn_unused_settings(args, [spec.text for spec in specs])
    out_dir = measure_out_dir(args.out, config.recipe)
    markdown, _ = measure(config, specs, steps, out_dir, command_line(getattr(args, "argv", [])),
                          append=args.append)
    print(markdown.read_text())
    print(f"report: {markdown}")
    return 0


def _register_memory(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "memory", help="memory: the paper's estimates, or measured peaks of real training steps",
        description="Without --measure: the paper's memory estimate of parameters, gradients and "
                    "optimizer states in BF16 for its LLaMA sizes, methods and baselines (appendix C.1; "
                    "not every method of fira-train methods), then the estimate of a real run on a GPU "
                    "(one 256-token sequence per step, with activations) of AdamW, GaLore, Fira and "
                    "Fira's memory options at 60M-7B and whether it fits in 24 GB; with --methods (and "
                    "--recipe), only the run estimate of those specs (at that recipe). "
                    "With --measure: train --steps steps of each method spec (NAME[@key=value...]) "
                    "in a fresh process and write OUT/memory.md and OUT/memory.json with the "
                    "measured peak beside the estimate.")
    parser.add_argument("--measure", action="store_true", help="measure real training steps")
    parser.add_argument("--recipe", help="the recipe (60m, 130m, 350m, 1b, tiny, ...); without --measure: "
                                         "the run estimate at this recipe only")
    parser.add_argument("--methods", action=StoreOnce,
                        help="comma-separated method specs to measure, or without --measure to estimate, e.g. "
                             "adamw,fira,fira@optim.step_in_backward=true@optim.state_dtype=int8")
    parser.add_argument("--steps", type=int, default=None,
                        help="with --measure: training steps per method (default 3)")
    parser.add_argument("--out", help="output directory (default runs/<recipe>-memory)")
    parser.add_argument("--append", action="store_true",
                        help="with --measure: keep the rows already in OUT/memory.json (same recipe, steps, "
                             "machine and allocator settings; rows may differ in train.num_threads), replace those of methods measured again, and "
                             "list this command beside the earlier ones; several such commands may measure "
                             "into one OUT side by side (where fcntl locks exist: Linux, macOS)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides for every method, e.g. train.batch_size=1 "
                             "train.micro_batch_size=1")
    parser.set_defaults(func=_memory)


def _methods(args: argparse.Namespace) -> int:
    from fira_train.config.recipes import TUNED_LR
    from fira_train.methods.registry import METHODS  # imports torch: not at parser build

    width = max(len(name) for name in METHODS)
    for method in METHODS.values():
        tuned = "".join(f" ({recipe}: {lrs[method.name]:g})" for recipe, lrs in TUNED_LR.items()
                        if method.name in lrs)
        print(f"{method.name:<{width}}  lr {method.default_lr:<6g} {method.description}{tuned}")
        if args.settings:
            print(f"{'':<{width}}  reads {', '.join(f'optim.{key}' for key in sorted(method.uses))}")
    return 0


def _register_methods(subparsers: Any) -> None:
    parser = subparsers.add_parser("methods", help="list the training methods, their default learning rates and the recipes' tuned ones")
    parser.add_argument("--settings", action="store_true",
                        help="also list the optim.* settings each method reads beside optim.lr (the others "
                             "have no effect on its runs; fira-train warns when one is given)")
    parser.set_defaults(func=_methods)


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command ``args`` chose, the deepest (``analyze spikes``): argparse
    reports a flag none of them knows with the top level's usage."""
    while True:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, actions[0].dest, None) if actions else None
        if chosen not in (actions[0].choices if actions else {}):
            return parser
        parser = actions[0].choices[chosen]


def _no_overrides(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """What a ``key=value`` among ``unknown`` is to a command that takes none (``finetune``,
    ``methods``): pretrain's config overrides (``optim.state_dtype=int8``) have no meaning there,
    and argparse's "unrecognized arguments" alone did not say so."""
    takes_overrides = any(action.dest == "overrides" for action in parser._actions)
    if takes_overrides or not any("=" in item and not item.startswith("-") for item in unknown):
        return ""
    return (f" ({parser.prog} takes no key=value config overrides: its settings are its flags, "
            f"listed by {parser.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Pre-train LLaMA models with Fira, GaLore, AdamW, LoRA and more.")
    # key=value overrides may stand anywhere among a command's flags (fira_train.cli_args)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=IntermixedArgumentParser)
    _register_pretrain(subparsers)
    _register_compare(subparsers)
    _register_sweep(subparsers)
    _register_memory(subparsers)
    _register_methods(subparsers)
    for module_name in PLUGINS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and module_name.startswith(err.name):
                continue  # that plug-in is not part of this installation
            raise
        module.register(subparsers)
    return parser


def interrupted_hint(args: argparse.Namespace) -> str | None:
    """What a command stopped by Ctrl-C keeps, and how to continue it (None: nothing to continue)."""
    command = args.command
    if keeps_nothing(args):
        return None
    if before_the_run(args):  # --resume would continue the earlier run --out may hold, not this one
        return f"{nothing_written(args)}: the same command starts it again"
    instead = [f for f, given in (("--overwrite", getattr(args, "overwrite", False)),
                                  ("--resume-step", getattr(args, "resume_step", None) is not None)) if given]
    also = f" (instead of {' and '.join(instead)})" if instead else ""
    if no_checkpoint_yet(args) or out_not_there(args):
        if command == "pretrain":
            return (f"no checkpoint was written yet (the first comes at train.save_every): the same command with "
                    f"{CONTINUES_WITH[command]}{also} starts the run again from step 0")
        return (f"nothing was kept yet (no run finished, and the first checkpoint comes at train.save_every): the "
                f"same command with {CONTINUES_WITH[command]}{also} starts again from the beginning")
    if command in ("pretrain", "compare"):
        finished = ", and compare keeps the finished runs" if command == "compare" else ""
        return (f"checkpoints written so far are kept (train.save_every): the same command with "
                f"{CONTINUES_WITH[command]}{also} continues from the newest{finished}")
    if command == "sweep":
        return f"finished runs and checkpoints are kept: the same command with {CONTINUES_WITH[command]}{also} " \
               "continues"
    if command == "analyze":
        return (f"finished runs and checkpoints are kept (train.save_every): the same command with "
                f"{CONTINUES_WITH[command]}{also} continues the others from their newest")
    if command == "memory" and getattr(args, "measure", False):
        out = measure_out_dir(getattr(args, "out", None), args.recipe)
        if not Path(out, "memory.json").is_file():
            return "no method was measured yet: the same command measures them all"
        missing = _not_measured_yet(Path(out, "memory.json"))
        if missing:  # the table names them: no cutting of --methods left to the user
            return (f"the methods measured so far are kept in {out}/memory.json: the same command with "
                    f"--append and --methods {','.join(missing)} measures the rest")
        return (f"the methods measured so far are kept in {out}/memory.json: the same command with "
                f"{CONTINUES_WITH[command]}, adds the rest")
    if command == "finetune":
        folder, kept = finetune_checkpoints(args)
        if folder is None:
            return None  # zero-shot: nothing to continue
        if not kept:  # (with --save-steps 0, an earlier start's are still continued)
            if not args.save_steps:  # none written, none kept: said, as it is lost
                return ("no checkpoint is written with --save-steps 0: the training done so far is lost, and the "
                        "same command starts the run again from step 0")
            return (f"no checkpoint was written yet (the first comes at step {args.save_steps}, --save-steps): "
                    "the same command starts the run again from step 0")
        return (f"checkpoints written so far are kept in {folder} (--save-steps): the same command "
                "continues from the newest")
    return None


def _not_measured_yet(path: Path) -> list[str]:
    """The specs a ``memory --measure`` table names as not measured yet (its ``missing``); ``[]``
    where it names none or cannot be read (the hint then says it in general)."""
    from fira_train.files import read_json

    try:
        missing = read_json(path).get("missing")
    except Exception:  # noqa: BLE001 - a hint after Ctrl-C: a damaged file is not a second error
        return []
    return missing if isinstance(missing, list) and all(isinstance(m, str) for m in missing) else []


def _stdout_gone() -> bool:
    """Whether nobody reads stdout any more (a pipe whose reader closed: ``poll`` reports an error
    on it); then stdout goes to the null device, so that the interpreter's last flush does not
    fail on it again. A broken pipe of anything else is not this."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no file descriptor
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


class _Stdout:
    """``sys.stdout`` while a command runs: an ``OSError`` raised writing it (a full disk behind a
    redirection, ``> /dev/full``) carries ``stream`` = "standard output", which no file name says
    (:mod:`fira_train.user_errors` blamed the run folder)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with _marked():
            return self._stream.write(text)

    def flush(self) -> None:
        with _marked():
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _marked() -> Iterator[None]:
    try:
        yield
    except OSError as err:
        err.stream = "standard output"
        raise


#: How long a process of a ``torchrun`` launch other than rank 0 waits, after an error of the
#: command line, for torchrun to end it (:func:`_rank_zero_says_it`).
RANK_ZERO_GRACE_S = 30.0


def _another_rank() -> bool:
    """Whether this process is one of several of a launch (``WORLD_SIZE`` above 1) other than
    rank 0, which then says what the command line did wrong for all. A lone process with
    ``RANK`` left in its environment has no rank 0 to leave it to: it says it itself."""
    return not is_rank_zero() and launched_world_size() > 1


def _rank_zero_says_it() -> bool:
    """Whether to leave an error of the command line (:func:`same_on_every_rank`) to rank 0 to
    print, on another rank. torchrun ends every process of a launch as soon as one fails: had
    this one exited at once, rank 0 could be ended before it printed the error, and nobody would
    have said it. So under torchrun (``TORCHELASTIC_RUN_ID`` set) it waits
    :data:`RANK_ZERO_GRACE_S` seconds, for torchrun to end it once rank 0 has printed and exited;
    still running then, rank 0 did not say it, and it says it itself (False). Another launcher
    (``RANK`` set otherwise): at once True."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return True
    time.sleep(RANK_ZERO_GRACE_S)
    return False


@contextlib.contextmanager
def _stderr_on_rank_zero() -> Iterator[None]:
    """Standard error as it is on rank 0 (and in a process without ``torchrun``); on the other
    ranks of a launch, what is written there (argparse's refusal of the command line, which every
    rank refuses alike) is left to rank 0 (:func:`_rank_zero_says_it`)."""
    if not _another_rank():
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except SystemExit as exit_:
        if exit_.code not in (0, None) and not _rank_zero_says_it():
            sys.stderr.write(held.getvalue())
        raise


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fira-train`` and ``python -m fira_train``; returns the exit status. After
    Ctrl-C (status 130) the process ignores further SIGINTs: it is expected to exit."""
    try:
        parser = build_parser()
    except ModuleNotFoundError as err:  # installed without the [train] extra: what to install
        message = describe(err)
        if message is None:
            raise
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    argv = sys.argv[1:] if argv is None else list(argv)
    with _stderr_on_rank_zero():  # a command line argparse refuses, every process refuses: rank 0 says why
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # the command's usage and name, not the top level's ("fira-train [-h] COMMAND ...")
            chosen = _chosen_parser(parser, args)
            chosen.error(f"unrecognized arguments: {' '.join(unknown)}{_no_overrides(chosen, unknown)}")
    args.argv = argv  # recorded in reports
    # Under torchrun only rank 0 reports progress; every rank reports warnings and errors (but those
    # of the command line and its config, which rank 0 reports for all: same_on_every_rank).
    configure_logging(logging.INFO if is_rank_zero() else logging.WARNING)
    stdout = sys.stdout
    if stdout is not None:  # None: no file descriptor 1 (`>&-`, pythonw), where print writes nothing
        sys.stdout = _Stdout(stdout)
    formatwarning = warnings.formatwarning
    warnings.formatwarning = one_line_warnings(f"{PROG} {args.command}")
    try:
        status = int(args.func(args) or 0)
        if sys.stdout is not None:
            sys.stdout.flush()  # here, where a failed write is one line, not at the interpreter's exit
        return status
    except KeyboardInterrupt as interrupt:  # Ctrl-C: what is kept and how to go on, not a traceback
        # The process ends now. A second Ctrl-C (pressed twice; `timeout -s INT`, which signals the
        # process and then its whole group) raised another KeyboardInterrupt wherever it landed --
        # in the hint below, or in an exit handler (torch's, multiprocessing's, tqdm's monitor's) --
        # and Python printed its traceback after the line below. So SIGINT is ignored from here to
        # the exit (SIGTERM and SIGKILL still end the process). Inline, not in a function, and a
        # signal already pending is taken here (signal.signal raises it before it sets the
        # handler, a function call before its first line): either way it is the same Ctrl-C.
        # Only the main thread may set a handler (ValueError elsewhere: its caller decides).
        while True:
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                break
            except KeyboardInterrupt:
                continue
            except ValueError:
                break
        args.before_the_run = getattr(interrupt, BEFORE_THE_RUN, False)  # a new run's data being built
        hint = interrupted_hint(args)
        print(f"{PROG} {args.command}: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return 130  # the shell's status for SIGINT
    except Exception as err:  # what users do: one line (fira_train.user_errors); a bug: its traceback
        if isinstance(err, BrokenPipeError) and _stdout_gone():
            return 141  # the shell's status for SIGPIPE: `fira-train methods | head` read what it wanted
        message = describe(err, args)
        if message is None:
            raise
        if getattr(err, SAME_ON_EVERY_RANK, False) and _another_rank() and _rank_zero_says_it():
            return 1
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = stdout
        warnings.formatwarning = formatwarning
