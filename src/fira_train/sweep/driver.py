"""``fira-train sweep``: tune each method's learning rate on validation, then report test
perplexity over seeds with paired intervals (:func:`sweep`).

``fira-train sweep --recipe tiny --methods adamw,fira,galore --lrs 0.001,0.003,0.01,0.02
--lrs adamw:0.001,0.003,0.01,0.02,0.03 --seeds 0,1,2 --jobs 2 --reuse --out DIR`` trains the grid
(:mod:`fira_train.sweep.grid`), chooses and summarizes (:mod:`fira_train.sweep.summary`) and
writes ``DIR/sweep.json``, ``DIR/report.md`` and ``DIR/lr.png`` (:mod:`fira_train.sweep.report`).
:func:`rewrite_report` (``--report-only``) writes the three again from ``DIR/sweep.json`` alone,
training nothing: a finished sweep's report in the current report format.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

from fira_train.config.comma_list import comma_list, distinct
from fira_train.config.method_spec import SHARED, parse_method_specs, refuse_same_runs, refuse_spec_keys
from fira_train.config.run_config import RunConfig
from fira_train.data.build import build_corpus, refuse_out_as_corpus
from fira_train.files import DamagedFileError, check_report_owner, read_json, refuse_links
from fira_train.provenance import code_version
from fira_train.run.launch import refuse_torchrun, same_on_every_rank
from fira_train.sweep.grid import RunKey, RunResult, execute, grid_runs, seed_runs
from fira_train.sweep.report import REPORT_TITLE, plot_lr, read_runs, write_json, write_markdown
from fira_train.sweep.summary import MethodSummary, summarize

log = logging.getLogger(__name__)


def parse_numbers(flag: str, text: str, kind: type) -> list:
    """``"0.001,0.003"`` -> numbers of ``kind`` (positive floats, or ints >= 0), none twice, none
    empty (:mod:`fira_train.config.comma_list`)."""
    values = []
    for part in comma_list(text, flag):
        try:
            value = kind(part)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not a{'n integer' if kind is int else ' number'} "
                             f"(in {text!r})") from None
        if (kind is float and not (math.isfinite(value) and value > 0)) or (kind is int and value < 0):
            raise ValueError(f"{flag}: {part!r} must be {'a positive finite number' if kind is float else '>= 0'}")
        values.append(value)
    return distinct(values, text, flag)


def parse_lr_grids(entries: Sequence[str], specs: Sequence[str]) -> dict[str, list[float]]:
    """``--lrs`` entries -> each spec's grid. ``"LR,LR"`` is every spec's grid; ``"SPEC:LR,LR"``
    replaces that spec's (the spec as written in ``--methods``)."""
    default: list[float] | None = None
    own: dict[str, list[float]] = {}
    for entry in entries:
        spec, sep, values = entry.rpartition(":")
        if not sep:
            if default is not None:
                raise ValueError(f"--lrs: two grids for every method ({','.join(map(str, default))} and {entry!r}); "
                                 f"give one, and SPEC:LR,... for a method's own")
            default = parse_numbers("--lrs", entry, float)
            continue
        if spec not in specs:
            raise ValueError(f"--lrs {entry!r}: {spec!r} is not among --methods ({', '.join(specs)})")
        if spec in own:
            raise ValueError(f"--lrs: two grids for {spec!r}")
        own[spec] = parse_numbers(f"--lrs {spec}", values, float)
    missing = [s for s in specs if s not in own and default is None]
    if missing:
        raise ValueError(f"--lrs gives no grid for {', '.join(missing)}: add LR,LR,... for every method")
    if default is not None and all(s in own for s in specs):  # a grid given for nothing: a slip
        raise ValueError(f"--lrs: the grid for every method ({','.join(map(str, default))}) applies to none: each "
                         f"of --methods has its own (SPEC:LR,...); drop it, or a method's own grid")
    return {spec: sorted(own.get(spec, default or [])) for spec in specs}


def check_run_folders(lr_grids: dict[str, list[float]]) -> None:
    """ValueError naming ``--lrs`` if two learning rates of a spec's grid would train into one
    run folder: :meth:`RunKey.folder` names an lr to 6 significant digits (``lr=0.001``), so
    0.001 and 0.0010000001, distinct numbers, would share ``OUT/<spec>/lr=0.001/seed=S/`` (the
    second run found the first's folder and stopped the sweep after training it)."""
    for spec, lrs in lr_grids.items():
        folders: dict[str, float] = {}
        for lr in lrs:
            name = RunKey(spec, lr, 0).folder(Path()).parent.name
            if name in folders:
                raise ValueError(f"--lrs {spec}: {folders[name]!r} and {lr!r} would share the run folder {name} "
                                 "(runs are named by the lr to 6 significant digits): give lrs that differ there")
            folders[name] = lr


#: What the sweep sets for each run itself (--lrs, --seeds, --out): overrides of them are refused.
SWEEP_SETS = ("optim.method", "optim.lr", "train.seed", "train.out_dir")


def check_specs(specs: Sequence[str]) -> None:
    """The sweep sets the lr and the seed, and trains every method on the same data and tokens:
    a spec that overrides one of those is an error."""
    parsed = parse_method_specs(",".join(specs))
    refuse_spec_keys(parsed, SWEEP_SETS, "the sweep sets it itself (--lrs, --seeds, --out)")
    refuse_spec_keys(parsed, SHARED, "the sweep trains every method on the same data and tokens; set it for "
                                     "all of them with key=value")


def sweep(config: RunConfig, specs: Sequence[str], lr_grids: dict[str, list[float]], seeds: Sequence[int],
          out_dir: str | Path, *, jobs: int = 1, reuse: bool = False, all_seeds: bool = False,
          reference: str | None = None, command: str | None = None) -> tuple[Path, list[MethodSummary]]:
    """Train the sweep (grid, then seeds at each chosen lr) and write its files; the report's path
    and the summary rows."""
    code_version()  # read now: a diverged run's marker records the code this process loaded
    # each process would sweep into the same --out, and each run's process, a process of that
    # launch, would refuse train.parallel='none' and suggest --parallel, refused below
    refuse_torchrun("sweep runs each training in its own process (--jobs)")
    with same_on_every_rank():  # the command line: under torchrun every process refuses it alike
        if config.train.parallel != "none":
            raise ValueError(f"sweep runs each training in its own process (--jobs); train.parallel="
                             f"{config.train.parallel!r} is not supported: launch pretrain under torchrun instead")
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    check_specs(specs)
    for spec in parse_method_specs(",".join(specs)):  # each method's config checked before a run
        spec.config(config, out_dir)
    refuse_same_runs(parse_method_specs(",".join(specs)), config)
    reference = reference or ("fira" if "fira" in specs else specs[0])
    if reference not in specs:
        raise ValueError(f"--reference {reference!r} is not among --methods ({', '.join(specs)})")
    check_run_folders(lr_grids)
    out = Path(out_dir)
    refuse_out_as_corpus(config.data, out, own_files="sweep.json")  # before anything is written there
    refuse_links(out)
    check_report_owner(out, (REPORT_TITLE,), "sweep")
    if not reuse and (out / "sweep.json").exists():
        # a sweep of other runs than this one's met no run folder in its way, and its first
        # result replaced the record (and report) of the sweep made there before
        raise FileExistsError(f"--out {str(out)!r} holds a sweep's sweep.json already: pass --reuse to continue "
                              "or extend that sweep (its finished runs are reused), or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    settings = {"recipe": config.recipe, "methods": list(specs), "lrs": lr_grids, "seeds": list(seeds),
                "all_seeds": all_seeds, "reference": reference, "command": command,
                "selection": "lowest mean final validation perplexity over the seeds run at an lr"}
    results: dict[RunKey, RunResult] = {}

    def write() -> list[MethodSummary]:
        return _write_files(out, settings, results)

    def record(result: RunResult) -> None:
        results[result.key] = result
        k = result.key
        log.info("sweep: %s lr %g seed %d: val ppl %.2f%s (%d runs done)", k.spec, k.lr, k.seed, result.val_ppl,
                 "" if result.test_ppl is None else f", test ppl {result.test_ppl:.2f}", len(results))
        write()

    # the tokenizer and token cache, built once before any worker needs them; a reused run must
    # have been trained on this corpus
    data = build_corpus(config.data).describe()
    execute(grid_runs(specs, lr_grids, seeds, all_seeds), config, out, data, jobs=jobs, reuse=reuse,
            on_result=record)
    rows = write()
    # A method whose every lr diverged has nothing to repeat.
    chosen = {row.spec: row.chosen_lr for row in rows
              if row.chosen_lr is not None and row.val is not None and math.isfinite(row.val.mean)}
    execute(seed_runs(chosen, seeds), config, out, data, jobs=jobs, reuse=reuse, on_result=record,
            done=set(results))
    return out / "report.md", write()


def _write_files(out: Path, settings: dict, results: dict[RunKey, RunResult]) -> list[MethodSummary]:
    grid_seeds = list(settings["seeds"]) if settings["all_seeds"] else list(settings["seeds"][:1])
    rows = summarize(settings["methods"], settings["lrs"], results, settings["reference"], grid_seeds)
    write_json(out / "sweep.json", settings, results, rows)
    write_markdown(out / "report.md", settings, rows, [r.code for r in results.values()])
    plot_lr(out / "lr.png", rows)
    return rows


def rewrite_report(out_dir: str | Path) -> tuple[Path, list[MethodSummary]]:
    """Write ``OUT``'s ``sweep.json``, ``report.md`` and ``lr.png`` again from the runs that
    ``OUT/sweep.json`` records (training nothing, reading no run folder); the report's path and rows."""
    out = Path(out_dir)
    refuse_links(out)  # its plot is written in place
    check_report_owner(out, (REPORT_TITLE,), "sweep")  # as a sweep does: another's report.md stays
    hint = "a sweep's report is rebuilt from it: run the sweep with --reuse"
    saved = read_json(out / "sweep.json", hint=hint)
    try:  # valid JSON of another shape (edited, another tool's): named, not a traceback
        missing = [key for key in SWEEP_KEYS if key not in saved]
        if missing:
            raise KeyError(", ".join(missing))
        settings = dict(saved)  # the keys in the order sweep() writes them
        del settings["runs"]
        settings["methods"] = [m["spec"] for m in saved["methods"]]  # the summary rows, in --methods order
        settings["lrs"] = {spec: [float(lr) for lr in lrs] for spec, lrs in saved["lrs"].items()}
        settings["seeds"] = [int(seed) for seed in saved["seeds"]]
        runs = read_runs(saved)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        what = f"no {err.args[0]}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        raise DamagedFileError(out / "sweep.json", f"not a sweep's record: {what}", hint) from None
    return out / "report.md", _write_files(out, settings, runs)


#: What ``sweep.json`` holds that :func:`rewrite_report` reads.
SWEEP_KEYS = ("recipe", "methods", "lrs", "seeds", "all_seeds", "reference", "runs")
