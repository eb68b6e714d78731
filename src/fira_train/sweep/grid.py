"""The runs of a sweep: which (method spec, learning rate, seed) to train, where, and their outcome.

A sweep trains in two phases (:func:`grid_runs`, :func:`seed_runs`):

1. the learning-rate grid, every lr of each method at the first seed (every seed with
   ``all_seeds``);
2. at the lr each method's validation perplexity chose, the remaining seeds.

Each run is one ``train()`` in ``OUT/<spec>/lr=<lr>/seed=<seed>/``, in a fresh process
(:func:`fira_train.run.isolated.run_isolated`), up to ``jobs`` at a time. With ``reuse`` a
finished run with the same config is reused, a diverged one (``diverged.json``) is kept as
diverged, and an unfinished one continues from its latest checkpoint; a crash or kill loses
only the steps since each run's last checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fira_train.config.method_spec import parse_method_spec
from fira_train.config.overrides import config_to_dict
from fira_train.config.run_config import RunConfig
from fira_train.files import dumps, read_json
from fira_train.run.isolated import run_isolated
from fira_train.run.run_dir import finished_with
from fira_train.run.train import train

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


def run_config(base: RunConfig, key: RunKey, out_dir: Path, threads: int) -> RunConfig:
    """``base`` with the spec's overrides, the lr, the seed, the run's folder (and ``threads``
    CPU threads when several runs share the machine)."""
    config = parse_method_spec(key.spec).config(base, out_dir)
    train_config = replace(config.train, seed=key.seed, out_dir=str(key.folder(out_dir)))
    if threads:
        train_config = replace(train_config, num_threads=threads, progress=False)
    return replace(config, optim=replace(config.optim, lr=key.lr), train=train_config)


def grid_runs(specs: Sequence[str], lrs: dict[str, list[float]], seeds: Sequence[int],
              all_seeds: bool) -> list[RunKey]:
    """Phase 1: every lr of every spec at the first seed (at every seed with ``all_seeds``)."""
    grid_seeds = list(seeds) if all_seeds else [seeds[0]]
    return [RunKey(spec, lr, seed) for spec in specs for lr in lrs[spec] for seed in grid_seeds]


def seed_runs(chosen: dict[str, float], seeds: Sequence[int]) -> list[RunKey]:
    """Phase 2: the seeds at each spec's chosen lr (those already run are found and reused)."""
    return [RunKey(spec, lr, seed) for spec, lr in chosen.items() for seed in seeds]


def _saved_result(key: RunKey, config: RunConfig, folder: Path) -> RunResult | None:
    """The outcome of ``key`` if its folder holds a finished or diverged run of ``config``."""
    if finished_with(config, folder):
        summary = read_json(folder / "summary.json")
        return RunResult(key, _ppl(summary.get("val_ppl")), summary.get("test_ppl"))
    marker = folder / DIVERGED_FILE
    if marker.exists():
        saved = read_json(marker, hint="delete it to train the run again")
        if saved.get("config") == json.loads(dumps(config_to_dict(config))):  # as JSON keeps it
            return RunResult(key, math.inf, None, diverged=True, detail=saved.get("error", ""))
    return None


def _ppl(value: Any) -> float:
    return math.inf if value is None else float(value)  # None: a non-finite value in summary.json


def _train_one(config: RunConfig, resume: str | None) -> RunResult | dict[str, Any]:
    """Train one run (in the child process); a divergence is an outcome, not an error."""
    try:
        summary = train(config, resume=resume)
    except FloatingPointError as err:  # DivergedError, NonFiniteLossError
        return {"diverged": f"{type(err).__name__}: {err}"}
    return {"val_ppl": summary["val_ppl"], "test_ppl": summary.get("test_ppl")}


def check_fresh(keys: Sequence[RunKey], out_dir: Path) -> None:
    """Without ``reuse``: an error naming the first run folder that exists already."""
    for key in keys:
        if key.folder(out_dir).exists():
            raise FileExistsError(
                f"{key.folder(out_dir)} exists already: pass --reuse to reuse finished runs and continue "
                f"unfinished ones from their checkpoints, or choose another --out")


def execute(keys: Sequence[RunKey], base: RunConfig, out_dir: Path, *, jobs: int, reuse: bool,
            on_result: Callable[[RunResult], None] | None = None,
            done: Collection[RunKey] = ()) -> dict[RunKey, RunResult]:
    """Train (or reuse) every run of ``keys`` but those in ``done``, up to ``jobs`` at a time,
    each in a fresh process.

    ``on_result`` is called in this process after each run, in completion order. An error other
    than a divergence stops new runs from starting; the ones running finish (their work is kept)
    and the first error is raised.
    """
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 and not base.train.num_threads else 0
    results: dict[RunKey, RunResult] = {}
    todo: list[tuple[RunKey, RunConfig]] = []
    for key in dict.fromkeys(keys):  # in order, without repeats
        if key in done:
            continue
        config = run_config(base, key, out_dir, threads)
        saved = _saved_result(key, config, key.folder(out_dir)) if reuse else None
        if saved is not None:
            results[key] = saved
            continue
        todo.append((key, config))
    if not reuse:
        check_fresh([key for key, _ in todo], out_dir)
    for key in results:
        if on_result is not None:
            on_result(results[key])
    error: BaseException | None = None
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        running: dict[Future, RunKey] = {}
        pending = list(todo)
        while pending or running:
            while pending and len(running) < jobs and error is None:
                key, config = pending.pop(0)
                log.info("sweep: training %s at lr %g, seed %d -> %s", key.spec, key.lr, key.seed,
                         config.train.out_dir)
                running[pool.submit(run_isolated, _train_one, config, "latest" if reuse else None)] = key
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                key = running.pop(future)
                try:
                    outcome = future.result()
                except Exception as err:  # noqa: BLE001 - raised after the running runs finish
                    log.error("sweep: %s at lr %g, seed %d failed: %s", key.spec, key.lr, key.seed, err)
                    error = error or err
                    continue
                result = _record(key, outcome, run_config(base, key, out_dir, threads), out_dir)
                results[key] = result
                if on_result is not None:
                    on_result(result)
    if error is not None:
        raise error
    return results


def _record(key: RunKey, outcome: dict[str, Any], config: RunConfig, out_dir: Path) -> RunResult:
    if "diverged" in outcome:
        folder = key.folder(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / DIVERGED_FILE).write_text(dumps({"error": outcome["diverged"],
                                                   "config": config_to_dict(config)}, indent=1) + "\n")
        log.warning("sweep: %s at lr %g, seed %d diverged (%s)", key.spec, key.lr, key.seed, outcome["diverged"])
        return RunResult(key, math.inf, None, diverged=True, detail=outcome["diverged"])
    return RunResult(key, _ppl(outcome["val_ppl"]), outcome["test_ppl"])
