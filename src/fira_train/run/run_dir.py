"""The run directory (``OUT``): whether a config may write, resume or reuse the run it holds."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from fira_train.config.overrides import changed_keys, describe_changed, flat_config
from fira_train.config.resolve import LEGACY_ALIGN_SIGNS, resolved, saved_config
from fira_train.config.run_config import RunConfig
from fira_train.data.corpus import data_change
from fira_train.data.spec import C4, C4_LOCAL_PREFIX, WIKI
from fira_train.files import parse_json, read_json, read_regular_text
from fira_train.methods.lora import legacy_rewarmup
from fira_train.methods.registry import get_method
from fira_train.provenance import describe_change
from fira_train.run import run_files

log = logging.getLogger(__name__)

#: Config keys that may differ between a run and its resumption (they do not change the
#: trajectory of the weights).
RESUMABLE_CHANGES = frozenset({
    "train.save_every", "train.keep_last", "train.eval_every", "train.progress",
    "train.tensorboard", "train.out_dir",
    # how long a collective waits for a hung process: the run trains the same either way
    "train.dist_timeout_s",
    # where tokenizers and tokens are cached: the data's own record (its token digest) is checked
    "data.cache_dir",
    # the same global batches at any world size or thread count: equal to round-off
    "train.parallel", "train.num_threads",
})


#: What a run may change on resume to take another amount of memory: its weights go on as they
#: would have (bit for bit in one process; another micro-batch size trains the same sequences
#: of each step in other micro-batches, equal to round-off: :data:`ROUND_OFF_LEVERS`). Not
#: :data:`RESUMABLE_CHANGES`: a finished run is not reused for a setting other than the one it
#: finished with, as its summary reports the memory it took.
MEMORY_LEVERS = ("train.activation_checkpointing", "optim.step_in_backward", "train.micro_batch_size")
#: The :data:`MEMORY_LEVERS` whose change sums the same gradients in another order.
ROUND_OFF_LEVERS = ("train.micro_batch_size",)
#: How the optimizer computes its step, not what: the same states (one state dict for every
#: implementation), so a resume may change them (off ``torch.compile``, onto the host's SVDs) at the
#: price of round-off. Not :data:`RESUMABLE_CHANGES`: a finished run is not reused for another one,
#: as its summary reports the speed it trained at.
IMPLEMENTATION_CHANGES = ("optim.implementation", "optim.host_refresh")


def resume_ignores(config: RunConfig) -> frozenset[str]:
    """The keys a resume of ``config`` may change: :data:`RESUMABLE_CHANGES`,
    :data:`IMPLEMENTATION_CHANGES` and the :data:`MEMORY_LEVERS`, but ``optim.step_in_backward``
    under ``train.precision=fp16``, where the checkpoint's loss scale is GradScaler's with a plain
    step and the handle's with updates in the backward pass."""
    levers = [key for key in MEMORY_LEVERS if key != "optim.step_in_backward" or config.train.precision != "fp16"]
    return RESUMABLE_CHANGES | frozenset(IMPLEMENTATION_CHANGES) | frozenset(levers)


#: What a resume may change, but not from the run's last step: nothing would train with it, and
#: the finished run would be recorded (and reused) as one trained with it.
NOT_FROM_LAST_STEP = MEMORY_LEVERS + IMPLEMENTATION_CHANGES


def changed_among(old: RunConfig, new: RunConfig, keys: tuple[str, ...]) -> list[str]:
    """The ``keys`` that ``new`` changes against ``old``."""
    return [key for key in config_changes(old, new, ignore=frozenset()) if key in keys]


def config_changes(old: RunConfig, new: RunConfig, ignore: frozenset[str] = RESUMABLE_CHANGES) -> list[str]:
    """The ``section.field`` keys in which ``new`` differs from ``old``, but for ``ignore`` and for
    the ``optim`` settings neither config's method reads
    (:meth:`~fira_train.methods.method.Method.reads`, as two method specs are the same run); the
    micro-batch size by the size it gives (None is the whole batch, as ``train.batch_size`` itself),
    and ``train.device`` only between two named kinds (``cpu`` against ``cuda``): ``auto`` names
    none (a config records it for a CPU and a GPU run alike), so against it the record of the
    device the run trained on decides: :func:`check_same_device` refuses a finished run of another
    kind, and a resume on another kind than the checkpoint's goes on with a warning
    (:func:`fira_train.run.resume_check.warn_round_off`). Read as the kind ``auto`` is here, a CPU
    run recorded as ``auto`` could not go on, or be reused, with ``cpu`` on a GPU machine."""
    methods = (get_method(old.optim.method), get_method(new.optim.method))
    return [key for key in changed_keys(flat_config(old), flat_config(new)) if key not in ignore
            and any(method.reads(key) for method in methods)  # what neither reads cannot change the run
            and (key != "train.micro_batch_size" or old.train.micro_batch != new.train.micro_batch)
            and (key != "train.device" or devices_differ(old.train.device, new.train.device))
            and (key != "data.source" or sources_differ(old.data.source, new.data.source))]


def sources_differ(old: str, new: str) -> bool:
    """Whether two ``data.source`` settings name two corpora: a local file or folder given once as
    ``corpus.txt`` and once as ``/abs/corpus.txt`` (or ``~/...``, ``c4:DIR`` alike) is one, where
    the strings were compared as typed and the resume refused. The data's own record (its token
    digest) is checked besides."""
    return old != new and _source_path(old) != _source_path(new)


def _source_path(source: str) -> str:
    """A local ``data.source`` as an absolute path (relative ones from the working directory);
    the named corpora (``wiki``, ``c4``) as they are."""
    if source in (WIKI, C4):
        return source
    prefix = C4_LOCAL_PREFIX if source.startswith(C4_LOCAL_PREFIX) else ""
    return prefix + os.path.realpath(os.path.expanduser(source[len(prefix):]))


def devices_differ(old: str, new: str) -> bool:
    """Whether two ``train.device`` settings name two kinds (``cpu`` and ``cuda``): ``auto`` names
    none, so against it the record of the device a run (or a measured row) ran on decides."""
    return old != new and "auto" not in (old, new)


def device_kind(device: str) -> str:
    """The kind of device ``train.device=device`` trains on here: ``auto`` is ``cuda`` where CUDA
    is available and ``cpu`` otherwise (as :func:`fira_train.run.training.resolve_device`, without
    its error for a ``cuda`` that is not there: the run itself reports that)."""
    if device != "auto":
        return device
    import torch  # the harness's runs import it anyway; the config modules do not

    return "cuda" if torch.cuda.is_available() else "cpu"


def describe_changes(old: RunConfig, new: RunConfig, changes: list[str]) -> str:
    """``"train.steps=5 (now 10), ..."``: each changed key with the run's value and the new one."""
    return describe_changed(flat_config(old), flat_config(new), changes)


def prepare_out_dir(config: RunConfig, out: Path, resume: str | int | None, overwrite: bool,
                    delete: bool = True) -> None:
    """Check that OUT may hold this run; with ``overwrite`` (and ``delete``: rank 0 only)
    remove a previous one. Files fira-train did not write are never deleted, and refused
    without ``overwrite`` (:func:`fira_train.run.run_files.check_foreign_files`); warned of by
    the process that deletes (another rank of a launch may look while rank 0 deletes: a run's
    ``metrics.jsonl`` without its ``config.json`` then read as a file of someone else's)."""
    run_files.check_foreign_files(out, resume, overwrite, warn=delete)
    previous = run_files.previous_run(out)
    if resume is None and previous:
        if not overwrite:
            raise FileExistsError(f"{str(out)!r} already holds a run ({', '.join(previous)}); pass "
                                  "--resume to continue it or --overwrite to start over")
        for name in ("metrics.jsonl", "summary.json", "config.json"):
            path = out / name
            if delete and path.is_dir():
                shutil.rmtree(path)
            elif delete and path.exists():
                path.unlink()
        if delete:  # their own entries alone: another tool's files there stay
            for name, ours in run_files.RUN_DIR_ENTRIES.items():
                run_files.remove_run_entries(out / name, ours)
    if resume is not None:
        refusal = resume_refusal(out, config)
        if refusal:
            raise ValueError(f"cannot resume {str(out)!r} with a different config: its config.json has {refusal}")


def resume_refusal(out: Path, config: RunConfig) -> str | None:
    """Why ``config`` (resolved) may not resume the run in ``out``: each setting it changes against
    ``out/config.json`` beyond :func:`resume_ignores` (the run's value and the new one), with a hint
    where a change of a default explains it; None where it may, or where there is no config.json.
    What :func:`prepare_out_dir` refuses a resume for, and what a sweep checks of every run before
    it starts one."""
    if not (out / "config.json").exists():
        return None
    saved = saved_config(read_json(out / "config.json", hint="restore it, or delete it and resume "
                                   "with the command line that started the run"))
    changes = config_changes(saved, config, resume_ignores(config))
    if not changes:
        return None
    hint = ""
    if "data.test_fraction" in changes and saved.data.test_fraction == 0:
        hint = "; a run made before the held-out test split resumes with data.test_fraction=0"
    if "data.epoch_order" in changes and saved.data.epoch_order == 1:
        hint += ("; a run made before each epoch's order was seeded from (seed, epoch) resumes with "
                 "data.epoch_order=1")
    if "optim.method" in changes:  # its lr (a method's tuned one) differs for that reason alone
        hint += f"; the run was made with --method {saved.optim.method}"
    elif "optim.lr" in changes:
        hint += (f"; a run made before the recipe's tuned learning rates (or at another lr) "
                 f"resumes with optim.lr={saved.optim.lr:g}")
    if ("optim.relora_rewarmup" in changes and saved.optim.relora_every
            and saved.optim.relora_rewarmup == legacy_rewarmup(saved.optim.relora_every)):
        hint += (f"; a ReLoRA run made before the re-warm-up's default of at least 10 steps (a quarter "
                 f"of a shorter cycle) resumes with optim.relora_rewarmup={saved.optim.relora_rewarmup}")
    if "optim.step_in_backward" in changes and config.train.precision == "fp16":
        hint += ("; under train.precision=fp16 a resume keeps the run's optim.step_in_backward: the "
                 "checkpoint's loss scale is GradScaler's with a plain step and the handle's with "
                 "updates in the backward pass")
    if "optim.align_signs" in changes and saved.optim.align_signs is LEGACY_ALIGN_SIGNS:
        hint += ("; a run made while aligned SVD signs were the default resumes with "
                 "optim.align_signs=true")
    return f"{describe_changes(saved, config, changes)} (resuming must reproduce the same run){hint}"


def continue_refusal(out: Path, config: RunConfig) -> str | None:
    """Why the run in ``out`` cannot go on from its checkpoints as a run of ``config`` (resolved):
    what its own ``--resume`` refuses, :func:`resume_refusal`'s changed settings against its
    ``config.json``, else the refusal of the checkpoint it would resume from, checked against that
    checkpoint's own record of its config
    (:func:`fira_train.run.resume_check.checkpoint_refusal`: a sitting stopped before its first
    save rewrote ``config.json``, not the checkpoints); None where it can. A sweep's ``--reuse``
    and a comparison's ``--resume`` check every run they would continue before they start one:
    each run's own process refuses the same, but only after the runs before it trained."""
    # imported here: resume_check builds its checks on this module's
    from fira_train.run.resume_check import checkpoint_refusal

    refusal = resume_refusal(out, config)
    if refusal is None:
        at_checkpoint = checkpoint_refusal(out, config)
        refusal = None if at_checkpoint is None else f"a checkpoint its resume refuses ({at_checkpoint})"
    return refusal


def finished_with(config: RunConfig, run_dir: Path, data: Mapping[str, Any] | None = None) -> bool:
    """Whether ``run_dir`` holds a finished run of ``config`` (learning rate resolved): equal up
    to the keys that do not change the weights' trajectory (:data:`RESUMABLE_CHANGES`).

    ``data``: what the corpus the config gives now says of itself (``Corpus.describe()``). A
    finished run of this config trained on other data (the same ``data.source`` whose text,
    split or tokenizer changed since) is then a ValueError: reusing its numbers beside runs on
    today's data would compare two corpora."""
    if not (run_dir / "summary.json").exists() or not (run_dir / "config.json").exists():
        return False
    saved = saved_config(read_json(run_dir / "config.json", hint="restore it, or delete the run's folder "
                                       "to train it again"))
    if config_changes(saved, resolved(config)):
        return False
    if data is not None:
        summary = read_json(run_dir / "summary.json", hint="delete it to train the run again")
        check_same_data(run_dir, summary, data)
    else:
        try:  # a damaged summary is the caller's to report (with its own way out)
            summary = parse_json(read_regular_text(run_dir / "summary.json"))
        except (OSError, ValueError):
            summary = None
    check_same_device(run_dir, summary, config)
    warn_other_code(run_dir, summary)
    return True


def warn_other_code(run_dir: Path, record: Any) -> None:
    """A warning if the finished (or diverged) run in ``run_dir``, whose ``summary.json`` (or
    marker) holds ``record``, was made by other code than this process runs: it is reused all the
    same (its config and data match), but a fix made since may have changed its numbers. A run
    made before runs recorded their code is reused without a word, as before."""
    recorded = record.get("code") if isinstance(record, dict) else None
    change = describe_change(recorded) if recorded is not None else None
    if change:
        log.warning("reusing %s, a run made by other code (%s): a fix made since may change its numbers; "
                    "delete its folder and run again to have them from this code",
                    run_dir, change)


def check_same_device(run_dir: Path, summary: Any, config: RunConfig) -> None:
    """ValueError if ``config`` would train on another kind of device than the finished run in
    ``run_dir`` did (its ``summary.json`` records the device): a CPU run trains in fp32, a GPU run
    with ``train.precision=auto`` in bf16 autocast, and a config records "auto" for both (and
    ``cpu`` finds a run recorded as ``auto``: :func:`config_changes`)."""
    recorded = summary.get("device") if isinstance(summary, dict) else None
    if not isinstance(recorded, str):
        return
    now = device_kind(config.train.device)
    if recorded.split(":")[0] != now:
        raise ValueError(f"{str(run_dir)!r} holds a run of this config trained on {recorded!r}, and "
                         f"train.device={config.train.device!r} trains on {now!r} here (another precision under "
                         "train.precision='auto'); reuse it on a machine of its kind, or train it again "
                         "with --overwrite, or choose another --out")


def check_same_data(run_dir: Path, summary: Any, data: Mapping[str, Any]) -> None:
    """ValueError if the finished run in ``run_dir``, whose ``summary.json`` holds ``summary``,
    records other data than ``data`` (see :func:`finished_with`), compared as
    :func:`fira_train.data.corpus.data_change` does."""
    saved = summary.get("data") if isinstance(summary, dict) else None
    change = data_change(saved, data) if isinstance(saved, dict) else None  # None: nothing recorded
    if change:
        raise ValueError(f"{str(run_dir)!r} holds a run of this config trained on other data than "
                         f"data.source={data.get('source')!r} gives now ({change}); train "
                         "it again with --overwrite, or choose another --out")
