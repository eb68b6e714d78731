"""The runs of a sweep: which (method spec, learning rate, seed) to train, where, and their outcome.

A sweep trains in two phases (:func:`grid_runs`, :func:`seed_runs`):

1. the learning-rate grid, every lr of each method at the first seed (every seed with
   ``all_seeds``);
2. at the lr each method's validation perplexity chose, the remaining seeds.

Each run is one ``train()`` in ``OUT/<spec>/lr=<lr>/seed=<seed>/``, in a fresh process
(:func:`fira_train.run.isolated.run_isolated_many`), up to ``jobs`` at a time. With ``reuse`` a
finished run with the same config is reused, a diverged one (``diverged.json``) is kept as
diverged, and an unfinished one continues from its latest checkpoint; a crash or kill loses
only the steps since each run's last checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fira_train.config.method_spec import parse_method_spec
from fira_train.config.overrides import config_to_dict
from fira_train.config.resolve import resolved, saved_config
from fira_train.config.run_config import RunConfig
from fira_train.files import dumps, read_json, write_text_atomic
from fira_train.run.isolated import run_isolated_many, with_threads
from fira_train.provenance import code_version, source_of
from fira_train.run.run_dir import (check_same_data, check_same_device, config_changes, continue_refusal,
                                   finished_with, warn_other_code)
from fira_train.run.train import train
from fira_train.run.training import resolve_device

log = logging.getLogger(__name__)

DIVERGED_FILE = "diverged.json"


@dataclass(frozen=True)
class RunKey:
    """One run of the sweep."""

    spec: str
    lr: float
    seed: int

    def folder(self, out_dir: Path) -> Path:
        """``OUT/<spec>/lr=<lr>/seed=<seed>`` (a spec holds no ``/``)."""
        return out_dir / self.spec / f"lr={self.lr:g}" / f"seed={self.seed}"


@dataclass(frozen=True)
class RunResult:
    """A finished run's final validation and test perplexity (``inf`` when it diverged; test
    ``None`` when the corpus has no test set)."""

    key: RunKey
    val_ppl: float
    test_ppl: float | None
    diverged: bool = False
    detail: str = ""
    #: the ``source`` digest of the code that made the run (:mod:`fira_train.provenance`);
    #: None for a run made before runs recorded it
    code: str | None = None


def run_config(base: RunConfig, key: RunKey, out_dir: Path, jobs: int = 1) -> RunConfig:
    """``base`` with the spec's overrides, the lr, the seed and the run's folder (and its share of
    the CPU threads when ``jobs`` runs share the machine)."""
    config = parse_method_spec(key.spec).config(base, out_dir)
    config = replace(config, optim=replace(config.optim, lr=key.lr),
                     train=replace(config.train, seed=key.seed, out_dir=str(key.folder(out_dir))))
    return with_threads(config, jobs)


def grid_runs(specs: Sequence[str], lrs: dict[str, list[float]], seeds: Sequence[int],
              all_seeds: bool) -> list[RunKey]:
    """Phase 1: every lr of every spec at the first seed (at every seed with ``all_seeds``)."""
    grid_seeds = list(seeds) if all_seeds else [seeds[0]]
    return [RunKey(spec, lr, seed) for spec in specs for lr in lrs[spec] for seed in grid_seeds]


def seed_runs(chosen: dict[str, float], seeds: Sequence[int]) -> list[RunKey]:
    """Phase 2: the seeds at each spec's chosen lr (those already run are found and reused)."""
    return [RunKey(spec, lr, seed) for spec, lr in chosen.items() for seed in seeds]


def _saved_result(key: RunKey, config: RunConfig, folder: Path, data: dict[str, Any]) -> RunResult | None:
    """The outcome of ``key`` if its folder holds a finished or diverged run of ``config`` (equal
    up to the keys that do not change a trajectory, as for resuming); one trained on other data
    than ``data`` (the corpus's description) is a ValueError."""
    if finished_with(config, folder, data):
        return _result(key, read_json(folder / "summary.json"))
    marker = folder / DIVERGED_FILE
    if marker.exists():
        saved = read_json(marker, hint="delete it to train the run again")
        if not config_changes(saved_config(saved["config"]), resolved(config)):
            # a marker written before it recorded data, the device or the code: not compared
            check_same_data(folder, saved, data)
            check_same_device(folder, saved, config)
            warn_other_code(folder, saved)
            return RunResult(key, math.inf, None, diverged=True, detail=saved.get("error", ""),
                             code=source_of(saved))
    return None


def _result(key: RunKey, summary: dict[str, Any]) -> RunResult:
    """A finished run's result; a perplexity JSON could not hold (non-finite: ``null``) is ``inf``."""
    test = summary.get("test_ppl")
    if test is None and summary.get("test_tokens"):
        test = math.inf
    return RunResult(key, math.inf if summary.get("val_ppl") is None else float(summary["val_ppl"]), test,
                     code=source_of(summary))


def _train_one(config: RunConfig, resume: str | None) -> dict[str, Any]:
    """Train one run (in the child process); a divergence is an outcome, not an error."""
    try:
        summary = train(config, resume=resume)
    except FloatingPointError as err:  # DivergedError, NonFiniteLossError
        return {"diverged": f"{type(err).__name__}: {err}"}
    return json.loads(dumps(summary))  # as summary.json holds it


def check_fresh(keys: Sequence[RunKey], out_dir: Path) -> None:
    """Without ``reuse``: an error naming the first run folder that exists already."""
    for key in keys:
        if key.folder(out_dir).exists():
            raise FileExistsError(
                f"{key.folder(out_dir)} exists already: pass --reuse to reuse finished runs and continue "
                f"unfinished ones from their checkpoints, or choose another --out")


def check_resumable(todo: Sequence[tuple[RunKey, RunConfig]], out_dir: Path) -> None:
    """With ``reuse``: a ValueError, before any run starts, naming every run to train whose folder
    holds a run of another config that it could not continue: the refusals each run's own process
    makes (:func:`~fira_train.run.run_dir.continue_refusal`), here once for them all, where each was
    refused only after its process had started (and the others had trained)."""
    refused: dict[str, list[str]] = {}
    for key, config in todo:
        folder = key.folder(out_dir)
        refusal = continue_refusal(folder, resolved(config))
        if refusal:
            refused.setdefault(refusal, []).append(str(folder.relative_to(out_dir)))
    if refused:
        count = sum(len(folders) for folders in refused.values())
        groups = ". ".join(f"{_and(folders)} {'has' if len(folders) == 1 else 'have'} {refusal}"
                           for refusal, folders in refused.items())
        raise ValueError(f"--reuse: {count} run{'s' if count > 1 else ''} in {out_dir} cannot be continued with "
                         f"this sweep's config, so no run was started: {groups}. Run the sweep with the settings "
                         "they were made with, or choose another --out")


def _and(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def execute(keys: Sequence[RunKey], base: RunConfig, out_dir: Path, data: dict[str, Any], *, jobs: int,
            reuse: bool, on_result: Callable[[RunResult], None] | None = None,
            done: Collection[RunKey] = ()) -> dict[RunKey, RunResult]:
    """Train (or reuse) every run of ``keys`` but those in ``done``, up to ``jobs`` at a time,
    each in a fresh process (:func:`fira_train.run.isolated.run_isolated_many`). ``data``: the
    description of ``base``'s corpus, built (and cached) by the caller before any worker needs
    it; a reused run must have been trained on it.

    ``on_result`` is called in this process after each run, in completion order. If a run fails
    (other than by diverging), the others still finish, then its error is raised.
    """
    results: dict[RunKey, RunResult] = {}
    todo: list[tuple[RunKey, RunConfig]] = []
    for key in dict.fromkeys(keys):  # in order, without repeats
        if key in done:
            continue
        config = run_config(base, key, out_dir, jobs)
        saved = _saved_result(key, config, key.folder(out_dir), data) if reuse else None
        if saved is not None:
            results[key] = saved
            if on_result is not None:
                on_result(saved)
        else:
            todo.append((key, config))
    if not todo:
        return results
    if reuse:
        check_resumable(todo, out_dir)
    else:
        check_fresh([key for key, _ in todo], out_dir)
    for key, config in todo:
        log.info("sweep: %s at lr %g, seed %d -> %s", key.spec, key.lr, key.seed, config.train.out_dir)

    def finished(index: int, outcome: dict[str, Any]) -> None:
        key, config = todo[index]
        result = _record(key, outcome, config, out_dir, data)
        results[key] = result
        if on_result is not None:
            on_result(result)

    calls = [(_train_one, (config, "latest" if reuse else None)) for _, config in todo]
    run_isolated_many(calls, jobs, on_result=finished)
    return results


def _record(key: RunKey, outcome: dict[str, Any], config: RunConfig, out_dir: Path,
            data: dict[str, Any]) -> RunResult:
    if "diverged" in outcome:
        folder = key.folder(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        # the device and code of this process: the run's own (its process ran here, on this code)
        write_text_atomic(folder / DIVERGED_FILE, dumps({"error": outcome["diverged"],
                                                         "config": config_to_dict(resolved(config)),
                                                         "data": data, "device": str(resolve_device(config)),
                                                         "code": code_version()}, indent=1) + "\n")
        log.warning("sweep: %s at lr %g, seed %d diverged (%s)", key.spec, key.lr, key.seed, outcome["diverged"])
        return RunResult(key, math.inf, None, diverged=True, detail=outcome["diverged"],
                         code=code_version()["source"])
    return _result(key, outcome)
