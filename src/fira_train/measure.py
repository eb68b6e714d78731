"""``fira-train memory --measure``: the peak memory that a few real training steps of each
method take, beside its estimate (:mod:`fira_train.memory.run_estimate`).

Each method spec (``NAME[@key=value...]``) trains ``steps`` steps in a fresh process
(:func:`fira_train.run.isolated.run_isolated`). On the CPU the measured peak is the process's
peak resident set during the steps minus its resident set just before the model is built (the
interpreter, torch, the tokenised corpus); on CUDA, ``torch.cuda.max_memory_allocated``. Writes
``OUT/memory.json`` (the recipe, steps, machine, command and settings, and a list of rows:
``method``, ``measured_peak_bytes``, ``estimated_bytes``, and their breakdowns, ``estimate`` and
``measured``; ``complete``, and while it is false ``missing``: the specs not measured yet) and
``OUT/memory.md``, after every method.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import platform
import re
import time
import warnings
from collections.abc import Iterable
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

import torch

from fira_optim.state import optimizer_state_bytes
from fira_train.config.method_spec import (MethodSpec, parse_method_spec, parse_method_specs, refuse_same_runs,
                                          refuse_spec_keys)
from fira_train.config.overrides import changed_keys, describe_changed, flat_config
from fira_train.config.run_config import RunConfig
from fira_train.data.build import build_corpus, refuse_out_as_corpus
from fira_train.files import check_report_owner, locked, read_json, refuse_links, write_text_atomic
from fira_train.memory.run_estimate import UNESTIMATED_METHODS, estimate_run_bytes, is_estimated, projects_nothing
from fira_train.report.markdown import format_bytes
from fira_train.run.isolated import run_isolated
from fira_train.run.launch import refuse_torchrun
from fira_train.run.run_dir import devices_differ
from fira_train.run.peak_memory import current_rss_bytes, env_prefix, malloc_env, reset_rss_peak, rss_peak_bytes
from fira_train.run.train import train_step
from fira_train.run.training import autocast_for, build_training, resolve_device

log = logging.getLogger(__name__)

#: Column "fits in 24 GB" (the peers' consumer-GPU headline) and the unit of the tables.
GB = 10**9
#: Below this estimate a measured peak is mostly the framework's memory (see format_measurement).
SMALL_ESTIMATE = 64 * 2**20


def build_measured(config: RunConfig) -> tuple[Any, torch.device, int, Any]:
    """``(corpus, device, baseline, training)``: the corpus loaded, the memory in use taken as the
    baseline (and the peak reset), then the model and optimizer built, so that everything
    measured from here on is the run's own. :func:`measure_run` and
    ``benchmarks/memory_phases.py`` start this way."""
    if config.train.num_threads:
        torch.set_num_threads(config.train.num_threads)
    corpus = build_corpus(config.data)
    device = resolve_device(config)
    # The model's code (transformers) is imported before the baseline: it is not the model.
    import transformers.models.llama.modeling_llama  # noqa: F401, I001
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        baseline = current_rss_bytes()
        # without Linux's VmRSS / VmHWM the peak read 0 (the row said 0 bytes), and a peak that
        # cannot be reset still holds the loading before the baseline: no number rather than a wrong one
        if baseline is None or not reset_rss_peak() or rss_peak_bytes() is None:
            raise ValueError("memory --measure on the CPU reads the process's resident set and resets its peak "
                               "(Linux: /proc/self/status, /proc/self/clear_refs), which this system does not "
                               "allow; measure on Linux, or on a CUDA device (train.device=cuda)")
    return corpus, device, baseline, build_training(config, corpus.vocab_size, device)


def measure_run(config: RunConfig, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps of ``config`` in this process and report its memory (run it in a
    fresh process: :func:`measure`)."""
    corpus, device, baseline, training = build_measured(config)
    micro = config.train.micro_batch
    stream = corpus.train_batches(micro, config.train.seed, cut=config.train.batch_size)  # as pretrain's
    autocast = autocast_for(config, device)
    losses, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        losses.append(train_step(training, config, stream, autocast, step)[0])
        # a step of a large model on the CPU takes minutes: without a line, a run that trained
        # read the same as one that hung (the run's progress bar is off: it would be measured)
        log.info("  step %d of %d: loss %.3f, %.1f s since the model was built", step, steps, losses[-1],
                 time.perf_counter() - start)
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    else:
        peak, kind = rss_peak_bytes(), "peak_rss_minus_rss_before_model"
    model = training.model
    return {
        "measured_peak_bytes": int(peak - baseline),
        "baseline_bytes": int(baseline),
        "measure": kind,
        "device": device.type,
        "vocab_size": corpus.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "optimizer_state_bytes": optimizer_state_bytes(training.optimizer),
        "losses": losses,
        "threads": torch.get_num_threads(),  # a spec's train.num_threads, not the command's
    }


def measure(config: RunConfig, specs: list[MethodSpec], steps: int, out_dir: str | Path,
            command: str | None = None, *, append: bool = False) -> tuple[Path, Path]:
    """Measure every spec in its own process; write ``memory.json`` and ``memory.md``.

    ``append``: keep the rows already in ``OUT/memory.json`` (it must hold the same recipe, number
    of steps, machine and allocator settings; rows may differ in threads), replace the rows of methods measured again, add the
    new ones after them, and add ``command`` to the record's commands. Every write re-reads the
    file under a lock (``OUT/.memory.lock``), so several such commands may measure into one folder
    side by side (on CUDA, ``max_memory_allocated`` is per process).
    """
    # each process would measure beside the others, each peak taken under their load, and write
    # OUT/memory.md over theirs
    refuse_torchrun("memory --measure measures each method in its own process")
    out_dir = Path(out_dir)
    refuse_out_as_corpus(config.data, out_dir, own_files="memory.json")  # before anything is written there
    refuse_links(out_dir)
    refuse_spec_keys(specs, ("train.steps",), f"memory --measure trains {steps} steps of every method (--steps)")
    # as the command-wide override is refused (the CLI): in a spec it reached the run's process,
    # which failed with a traceback (no process group), after the specs before it were measured
    refuse_spec_keys(specs, ("train.parallel",), "memory --measure measures each method in one process")
    if not append and (out_dir / "memory.json").exists():
        raise FileExistsError(_held_measurement(out_dir))
    # a memory.md of the user's (notes, another tool's table) was written over without a word
    check_report_owner(out_dir, (MEASUREMENT_TITLE,), "memory --measure", name="memory.md")
    base = replace(config, train=replace(config.train, steps=max(steps, 1), progress=False,
                                         tensorboard=False))
    configs = [spec.config(base, out_dir / "runs") for spec in specs]  # every spec checked before a run
    refuse_same_runs(specs, base)
    for run_config in configs:  # a device this machine lacks failed in its run, after the specs before it
        resolve_device(run_config)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"recipe": config.recipe, "steps": steps, "command": command,
              # the threads each measured process runs with (train.num_threads, else this process's)
              "machine": f"{platform.machine()}, {config.train.num_threads or torch.get_num_threads()} threads, "
                         f"torch {torch.__version__}",
              "date": date.today().isoformat(), "malloc_env": malloc_env(), "settings": shared_settings(base),
              "rows": []}
    json_path, md_path = out_dir / "memory.json", out_dir / "memory.md"

    def write(rows: list[dict[str, Any]], done: int) -> None:
        with locked(out_dir / ".memory.lock") if append else contextlib.nullcontext():
            # stopped (or read while it runs), the table names the specs still to measure: killed,
            # the command printed no hint, and "a command stopped" left them to find by hand
            written = (_merged(json_path, record, rows, done, len(specs)) if append
                       else {**record, "rows": rows, "complete": done == len(specs),
                             **({"missing": [spec.text for spec in specs[done:]]} if done < len(specs) else {})})
            write_text_atomic(json_path, json.dumps(written, indent=1) + "\n")
            write_text_atomic(md_path, format_measurement(written))

    if append:  # a mismatch stops before anything is trained; the command is listed from the start
        write([], 0)
    build_corpus(base.data)  # tokenised once, into the cache the runs read
    rows: list[dict[str, Any]] = []
    for index, (spec, run_config) in enumerate(zip(specs, configs), start=1):
        log.info("[%d/%d] %s: %d steps", index, len(specs), spec.text, steps)
        measured = run_isolated(measure_run, run_config, steps)
        estimate = (estimate_run_bytes(run_config, measured["vocab_size"], measured["device"])
                    if is_estimated(run_config.optim.method) else None)
        rows.append({"method": spec.text, "measured_peak_bytes": measured["measured_peak_bytes"],
                     "estimated_bytes": estimate and estimate["total"], "estimate": estimate,
                     "date": date.today().isoformat(),
                     "measured": {k: v for k, v in measured.items() if k != "measured_peak_bytes"}})
        log.info("[%d/%d] %s: measured %s, estimated %s", index, len(specs), spec.text,
                 format_bytes(measured["measured_peak_bytes"]), format_bytes(estimate["total"]) if estimate else "-")
        write(rows, index)  # after every method: a measurement stopped midway keeps what it measured
    return md_path, json_path


def _merged(json_path: Path, record: dict[str, Any], rows: list[dict[str, Any]], done: int,
            total: int) -> dict[str, Any]:
    """``record`` with ``rows`` merged into the rows of the record already in ``json_path`` (same
    method: replaced in place; new: added at the end) and its command after the earlier ones.

    While a command has measured ``done`` < ``total`` of its methods, its line carries
    ``  # stopped after done of total methods``. An incomplete earlier record without such marks
    (a table written without ``--append``, or by hand) gets the line :data:`EARLIER_STOP`. When
    every command line names its ``--methods``, the record is complete when each method they name
    has a row (a stopped command's methods may have been measured by a later one), and
    ``missing`` lists the others; else it is complete when no line says that a command stopped.
    A complete record's commands carry no such marks.
    """
    old = (read_json(json_path, hint="delete it, or measure into another --out without --append")
           if json_path.exists() else {**record, "command": None, "rows": []})
    wrong = _other_shape(old)
    if wrong:
        raise ValueError(f"--append: {json_path} is not a measurement written by memory --measure ({wrong}); "
                         "delete it, or measure into another --out")
    for key, what in (("recipe", "recipe"), ("steps", "number of steps"), ("machine", "machine"),
                      ("malloc_env", "allocator settings")):
        # the machine's line gives the command's thread count: rows may differ in threads (each
        # row records its own), a table may not in machine
        if (_machine_only(old.get(key)) if key == "machine" else old.get(key)) != (
                _machine_only(record[key]) if key == "machine" else record[key]):
            raise ValueError(f"--append: {json_path} was measured with {what} {old.get(key)!r}, this command "
                             f"with {record[key]!r}; one table holds one setting (measure into another --out)")
    if old.get("machine") != record["machine"]:  # another thread count: the line will give this command's
        for row in old["rows"]:  # a row that does not record its count keeps the one it was measured with
            count = _row_threads(row, old["machine"])
            if "threads" not in row["measured"] and count.isdigit():
                row["measured"]["threads"] = int(count)
    if "settings" in old:  # (tables written before it was recorded: their commands say it)
        # train.device=auto names no kind (as on a resume): each row records the device it ran on
        # a key of NOT_SHARED that a table recorded (written before it was left out) is no setting either
        changed = [key for key in changed_keys(old["settings"], record["settings"]) if key not in NOT_SHARED
                   and (key != "train.device" or devices_differ(old["settings"].get(key),
                                                                record["settings"].get(key)))]
        if changed:
            raise ValueError(f"--append: {json_path} was measured with other settings for every method: "
                             f"{describe_changed(old['settings'], record['settings'], changed)}; one table holds "
                             "one setting (measure into another --out)")
    # keyed by method and by command (without its mark): an update keeps an entry's place
    merged = {row["method"]: {"date": old["date"], **row} for row in old["rows"]}  # rows keep their day
    merged.update((row["method"], row) for row in rows)
    commands = {line.split(f"  {PROGRESS_MARK}")[0]: line for line in (old.get("command") or "").split("\n") if line}
    if old.get("complete", True) is False and not any(PROGRESS_MARK in c for c in commands.values()):
        commands[EARLIER_STOP] = EARLIER_STOP  # which command stopped is not known: the record says so for good
    if record["command"]:
        commands[record["command"]] = record["command"] + (
            "" if done == total else f"  {PROGRESS_MARK}{done} of {total} methods")
    missing = not_measured(commands, merged)
    if missing is None:
        stopped = any(PROGRESS_MARK in c for c in commands.values()) or EARLIER_STOP in commands
        complete, missing = not stopped and (bool(record["command"]) or done == total), []
    else:
        complete = not missing
    if complete:  # every method has its row: a note that a command stopped would read as a gap
        commands = {key: key for key in commands if key != EARLIER_STOP}
    return {**record, "command": "\n".join(commands.values()) or None, "rows": list(merged.values()),
            "complete": complete, **({"missing": missing} if missing else {}),
            "date": max([r["date"] for r in merged.values()], default=record["date"])}


#: What :func:`_merged` and :func:`format_measurement` read of an earlier record, of each of its
#: rows and of a row's ``measured``: key -> (the types it may have, whether it may be absent).
RECORD_SHAPE = {"rows": ((list,), False), "command": ((str, type(None)), True), "date": ((str,), True),
                "settings": ((dict,), True), "complete": ((bool,), True)}
ROW_SHAPE = {"method": ((str,), False), "measured_peak_bytes": ((int,), False),
             "estimated_bytes": ((int, float, type(None)), False), "date": ((str,), True),
             "measured": ((dict,), False)}
MEASURED_SHAPE = {"parameters": ((int,), False), "device": ((str,), False), "weights_bytes": ((int,), False),
                  "optimizer_state_bytes": ((int,), False), "threads": ((int,), True)}


def _held_measurement(out_dir: Path) -> str:
    """Why a measurement without ``--append`` does not go into ``out_dir``, which holds a
    ``memory.json``: one of ours takes ``--append``; another tool's (or a damaged one), which
    ``--append`` then refuses, does not."""
    try:
        wrong = _other_shape(read_json(out_dir / "memory.json"))
    except (OSError, ValueError) as err:
        wrong = str(err)
    if wrong:
        return (f"--out {str(out_dir)!r} holds a memory.json that memory --measure did not write ({wrong}): choose "
                "another --out")
    return (f"--out {str(out_dir)!r} already holds a measurement (memory.json): pass --append to add these rows to "
            "it, or choose another --out")


def _other_shape(old: Any) -> str | None:
    """What in an earlier ``memory.json`` (valid JSON) is not as ``memory --measure`` writes it,
    else None. Checked at ``--append``'s first write, before anything is measured: a value of
    another type (an edited file, another tool's) failed in the middle of a merge, a row's date
    only once the first new row was measured."""
    if not isinstance(old, dict):
        return f"a JSON {type(old).__name__}, not an object"
    wrong = _wrong_keys(old, RECORD_SHAPE, "")
    if wrong:
        return wrong
    if old["rows"] and "date" not in old:
        return "no date"
    for number, row in enumerate(old["rows"], start=1):
        if not isinstance(row, dict):
            return f"row {number} is a JSON {type(row).__name__}, not an object"
        wrong = _wrong_keys(row, ROW_SHAPE, f"row {number}: ") or _wrong_keys(
            row["measured"], MEASURED_SHAPE, f"row {number}: measured.")
        if wrong:
            return wrong
    return None


def _wrong_keys(value: dict[str, Any], shape: dict[str, tuple[tuple[type, ...], bool]], where: str) -> str | None:
    """The first key of ``shape`` that ``value`` lacks or holds with another type, said in words."""
    for key, (types, optional) in shape.items():
        if key not in value:
            if not optional:
                return f"{where}no {key}" if key != "rows" else "no list of rows"
        elif not isinstance(value[key], types):
            return f"{where}{key} is {json.dumps(value[key])[:40]}, not {' or '.join(_json_type(t) for t in types)}"
    return None


def _json_type(kind: type) -> str:
    return {list: "a list", str: "a string", dict: "an object", bool: "true or false", int: "an integer",
            float: "a number", type(None): "null"}[kind]


#: What ``measure`` sets itself, what the record holds elsewhere (``steps``, ``machine``), and what
#: does not change a measured peak (where the cache lies, the seed, checkpoint and evaluation
#: cadence of the few steps measured, a collective's timeout: each method is measured in one
#: process; a table written before that key has none, which --append took for another setting).
NOT_SHARED = ("optim.method", "train.out_dir", "train.steps", "train.progress", "train.tensorboard",
              "train.num_threads", "data.cache_dir", "train.seed", "train.save_every", "train.keep_last",
              "train.eval_every", "train.dist_timeout_s")


def shared_settings(config: RunConfig) -> dict[str, Any]:
    """``{"section.key": value}``: the command's config, which every method's run starts from
    (a method spec's overrides come on top), less :data:`NOT_SHARED`."""
    flat = json.loads(json.dumps(flat_config(config)))  # as memory.json holds them: lists, not tuples
    return {key: value for key, value in flat.items() if key not in NOT_SHARED}


def not_measured(commands: Iterable[str], methods: Iterable[str]) -> list[str] | None:
    """The methods that the command lines name with ``--methods`` (``#`` lines are comments) and
    that are not among ``methods`` (the table's rows), in order; None where that cannot be
    told: a line names no ``--methods``, or a spec does not parse."""
    named: dict[str, None] = {}
    lines = [line for line in commands if line.strip() and not line.startswith("#")]
    for line in lines:
        words = line.split("#")[0].split()
        given = [after for word, after in zip(words, words[1:] + [""]) if word == "--methods"]
        given += [word.split("=", 1)[1] for word in words if word.startswith("--methods=")]
        if len(given) != 1:
            return None
        try:
            specs = parse_method_specs(given[0])
        except ValueError:
            return None
        named.update((spec.text, None) for spec in specs)
    measured = set(methods)
    return [method for method in named if method not in measured] if lines else None


#: Marks a command of an appended record that stopped before its last method.
PROGRESS_MARK = "# stopped after "
#: The line added to the commands of an incomplete record that does not say which command stopped.
EARLIER_STOP = "# (a command above stopped before its last method)"


#: How ``memory.md`` begins: a ``memory.md`` in ``--out`` that begins otherwise is not replaced.
MEASUREMENT_TITLE = "# Measured memory"


#: The command's thread count in a record's ``machine`` (``"x86_64, 4 threads, torch 2.6.0"``).
THREADS_SAID = r", (\d+) threads?,"


def _machine_only(machine: Any) -> Any:
    """A record's ``machine`` without the command's thread count."""
    return re.sub(THREADS_SAID, ",", machine) if isinstance(machine, str) else machine


def _row_threads(row: dict[str, Any], machine: str) -> str:
    """The threads a row was measured with: its own count, else its spec's ``train.num_threads``,
    else the count in ``machine`` (its record's), else ``"?"``."""
    said = re.search(THREADS_SAID, machine)
    try:
        own = parse_method_spec(row["method"]).setting("train.num_threads")
    except ValueError:  # a row's label that is no spec (a table edited by hand): no setting of its own
        own = None
    return str(row["measured"].get("threads", own if own not in (None, "0", "") else said[1] if said else "?"))


def format_measurement(record: dict[str, Any]) -> str:
    """``memory.md`` from ``memory.json``'s record."""
    rows = record["rows"]
    # a method spec may change the model (model.*) or the device (train.device): one value of
    # each is said in the heading, several in a column of their own
    sizes = list(dict.fromkeys(f"{row['measured']['parameters'] / 1e6:.1f}M" for row in rows))
    devices = list(dict.fromkeys(row["measured"]["device"] for row in rows))
    # a spec's own train.num_threads: the machine's line gave the command's count for every row
    # (a row measured before rows recorded their count ran with its spec's, else the command's)
    said = re.search(THREADS_SAID, record["machine"])

    def row_threads(row: dict[str, Any]) -> str:
        return _row_threads(row, record["machine"])

    threads = list(dict.fromkeys(row_threads(row) for row in rows))
    one = threads[0] if len(threads) == 1 else None
    machine = record["machine"] if not (said and threads) else record["machine"].replace(
        said[0], ", threads per row," if one is None else f", {one} thread{'' if one == '1' else 's'},")
    per_row = [(name, key) for name, key, values in (("Parameters", "parameters", sizes),
                                                     ("Device", "device", devices),
                                                     ("Threads", "threads", threads)) if len(values) > 1]
    dates = sorted({row.get("date", record["date"]) for row in rows} or {record["date"]})
    lines = [
        f"{MEASUREMENT_TITLE}: recipe `{record['recipe']}`, {record['steps']} training step{'s' if record['steps'] != 1 else ''}"
        + ("" if record.get("complete", True) else
           f" (incomplete: not measured yet: {', '.join(record['missing'])})" if record.get("missing") else
           " (incomplete: a command stopped before its last method)"),
        "",
        ("No method measured yet; " if not rows else
         f"{sizes[0] + ' parameters' if len(sizes) == 1 else 'parameters per row'}, "
         f"{f'device `{devices[0]}`' if len(devices) == 1 else 'device per row'}; ")
        + f"{machine}, {dates[0] if len(dates) == 1 else f'{dates[0]} to {dates[-1]}'}.",
        "",
        "| Method | " + "".join(f"{name} | " for name, _ in per_row)
        + "Measured peak | Estimated | Measured / estimated | Weights | Optimizer states | Fits in 24 GB (measured) |",
        "|---|---|---|---|---|---|---|" + "---|" * len(per_row),
    ]
    for row in rows:
        measured, estimated = row["measured_peak_bytes"], row["estimated_bytes"]
        cells = "".join(f"{row['measured']['parameters'] / 1e6:.1f}M | " if key == "parameters"
                        else f"`{row['measured']['device']}` | " if key == "device" else f"{row_threads(row)} | "
                        for _, key in per_row)
        lines.append(
            f"| {row['method']} | {cells}{format_bytes(measured)} | {format_bytes(estimated) if estimated else '-'} "
            f"| {f'{measured / estimated:.2f}' if estimated else '-'} "
            f"| {format_bytes(row['measured']['weights_bytes'])} "
            f"| {format_bytes(row['measured']['optimizer_state_bytes'])} "
            f"| {'yes' if measured < 24 * GB else 'no'} |")
    lines += [
        "",
        "- Measured peak: on the CPU, the peak resident set of the run's own process during the "
        "steps minus its resident set before the model was built; on CUDA, "
        "`torch.cuda.max_memory_allocated`.",
        "- Estimated: weights + gradients + optimizer states + activations + the step's "
        "temporaries (`fira_train.memory.run_estimate`)"
        # the estimate of a CUDA row outside step_in_backward is not the sum of its parts: said, so
        # that memory.json's breakdown, which does not add up to it, is not read as a mistake
        + ("; on CUDA, outside `optim.step_in_backward`, the larger of the activations and the step's "
           "temporaries, not their sum (`max_memory_allocated` counts live tensors, and the activations "
           "are freed before the step)" if "cuda" in devices else "")
        + "; the allocator's caches and BLAS/LAPACK workspaces are not in it.",
        # the sizes are in binary units and the threshold in decimal ones: said, so that a peak of
        # 23.00 GiB marked "no" is not read as a mistake
        f"- Sizes in MiB / GiB (2^20 / 2^30 bytes); fits in 24 GB: a measured peak below 24 GB = 24 x 10^9 "
        f"bytes ({format_bytes(24 * GB)}).",
    ]
    small = [row["method"] for row in rows if row["estimated_bytes"] and row["estimated_bytes"] < SMALL_ESTIMATE]
    if small:  # micro's rows measured several times their estimate: the framework, not the training
        lines.append(
            f"- Estimated under {format_bytes(SMALL_ESTIMATE)} ({', '.join(small)}): at such sizes the process's own "
            "memory beyond the training state (torch's kernels and thread pools, the allocator's arenas, BLAS "
            "workspaces) can outweigh what the estimate counts, so measured / estimated says little about the "
            "estimate there; check it on a model of 60M parameters or more.")
    if record.get("command"):
        lines += ["", "Command:", "", "```bash", env_prefix(record.get("malloc_env", {})) + record["command"], "```"]
    return "\n".join(lines) + "\n"


#: The parts of :func:`fira_train.memory.run_estimate.estimate_run_bytes`, in the table's order.
ESTIMATE_PARTS = ("weights", "gradients", "optimizer_states", "activations", "step_temporaries")

#: The configurations of the estimate table (``fira-train memory`` without ``--measure``).
ESTIMATE_SPECS = (
    "adamw", "galore", "fira", "fira@optim.step_in_backward=true",
    "fira@optim.step_in_backward=true@optim.state_dtype=int8",
    "fira@optim.step_in_backward=true@optim.state_dtype=int8@train.param_dtype=bfloat16",
)
ESTIMATE_SIZES = ("60m", "130m", "350m", "1b", "7b")


def estimate_rows(sizes=ESTIMATE_SIZES, specs=ESTIMATE_SPECS) -> list[dict[str, Any]]:
    """The run estimate (:func:`fira_train.memory.run_estimate.estimate_run_bytes`) of each
    configuration (a method spec's text) at each size (a recipe), one sequence per step unless a
    spec sets the batch, on a GPU (the column is "fits in 24 GB": torch's AdamW then takes its
    ``foreach`` step) unless the spec sets ``train.device=cpu`` (the row's ``"device"``). A spec of
    a method the estimate does not model is a ValueError naming it."""
    from fira_train.config.recipes import get_recipe  # the paper's sizes

    parsed = parse_method_specs(",".join(specs))
    for spec in parsed:
        if not is_estimated(spec.name):  # else a number for it would be full-weight AdamW's
            raise ValueError(f"--methods: {spec.text!r}: the run estimate does not model {spec.name!r} (not "
                             f"estimated: {', '.join(UNESTIMATED_METHODS)}); every other method of "
                             "fira-train methods is")
    rows = []
    for size in sizes:
        base = get_recipe(size)
        base = replace(base, train=replace(base.train, batch_size=1, micro_batch_size=1))
        for spec in parsed:
            config = spec.config(_batch_for(spec, base), ".")
            if projects_nothing(config):  # measured, the optimizer says it; estimated, nothing would
                warnings.warn(f"--methods {spec.text!r} at {size}: optim.rank={config.optim.rank} is >= min(m, n) of "
                              "every matrix: none is projected, so the estimate is the plain base optimizer's, "
                              "with full-rank states", UserWarning, stacklevel=2)
            device = "cpu" if config.train.device == "cpu" else "cuda"
            estimate = estimate_run_bytes(config, config.data.vocab_size, device)
            rows.append({"size": size, "method": spec.text, "device": device, **estimate,
                         "micro_batch": config.train.micro_batch, "seq_len": config.data.seq_len,
                         "fits_24gb": estimate["total"] < 24 * GB})
    return rows


def _batch_for(spec: MethodSpec, base: RunConfig) -> RunConfig:
    """``base`` (a batch of one sequence) with the batch of a spec that sets its micro-batch alone
    (``@train.micro_batch_size=4``): the estimate's batch of one is the table's, not the user's, and
    the spec was refused as no divisor of ``train.batch_size=1``."""
    given = spec.setting("train.micro_batch_size")
    if given is None or spec.setting("train.batch_size") is not None:
        return base
    try:
        micro = int(given)
    except ValueError:  # not a number: the spec's own error says so
        return base
    return replace(base, train=replace(base.train, batch_size=micro)) if micro >= 1 else base


def format_estimate_rows(rows: list[dict[str, Any]]) -> str:
    """The estimate table: GB per part and whether the total fits in 24 GB."""
    # a spec may set the batch, a recipe its sequence length: one shape is said, several a column
    shapes = list(dict.fromkeys(_batch_shape(r) for r in rows))
    shape = shapes[0] if len(shapes) == 1 else "the micro-batch of its row"
    # tiny's and micro's runs read 0.00-0.05 GB: rows all under 1 GB are in MB
    unit, exponent = ("GB", 9) if max((r["total"] for r in rows), default=0) >= GB else ("MB", 6)
    # a spec's train.device=cpu is estimated on the CPU: one device is said, both a column
    devices = {r["device"] for r in rows} or {"cuda"}
    where = ("on a GPU" if devices == {"cuda"} else "on the CPU" if devices == {"cpu"}
             else "on the device of its row")
    foreach = ("" if "cuda" not in devices else "; torch's AdamW in its default multi-tensor step"
               if devices == {"cuda"} else "; on a GPU, torch's AdamW in its default multi-tensor step")
    parts_said = ("the larger of activations and the step's temporaries (their sum with step_in_backward, "
                  "whose steps run among the activations)" if devices == {"cuda"}
                  else "activations + the step's temporaries" if devices == {"cpu"}
                  else "activations + the step's temporaries (on a GPU the larger of the two, their sum with "
                       "step_in_backward, whose steps run among the activations)")
    by_device = len(devices) > 1
    lines = [f"Estimated memory of a training run {where} ({shape} per step, fp32 unless stated{foreach}): "
             f"weights + gradients + optimizer states + {parts_said}, in {unit} (10^{exponent} bytes)",
             "",
             "| Size | Method | " + ("Device | " if by_device else "") + ("Micro-batch | " if len(shapes) > 1 else "")
             + "Weights | Gradients | Optimizer states | Activations | Step temporaries | Total | Fits in 24 GB |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if by_device else "") + ("---|" if len(shapes) > 1 else "")]
    for r in rows:
        parts = " | ".join(f"{r[k] / 10**exponent:.2f}" for k in ESTIMATE_PARTS + ("total",))
        shape = f"{_batch_shape(r)} | " if len(shapes) > 1 else ""
        device = f"{'GPU' if r['device'] == 'cuda' else 'CPU'} | " if by_device else ""
        lines.append(f"| {r['size']} | {r['method']} | {device}{shape}{parts} | {'yes' if r['fits_24gb'] else 'no'} |")
    return "\n".join(lines)


def _batch_shape(row: dict[str, Any]) -> str:
    """``"one 256-token sequence"``, ``"4 sequences of 256 tokens"``: an estimate row's micro-batch."""
    if row["micro_batch"] == 1:
        return f"one {row['seq_len']}-token sequence"
    return f"{row['micro_batch']} sequences of {row['seq_len']} tokens"
