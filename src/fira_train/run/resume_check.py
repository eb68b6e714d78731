"""Which checkpoint ``--resume`` continues from, checked before anything is loaded.

:func:`choose_checkpoint` is what :func:`fira_train.run.train.train` does with ``resume``:

- ``"latest"``: the newest complete checkpoint that is intact. A damaged one (a file whose
  size or SHA-256 differs from its marker's record, a truncated or empty file, a broken marker)
  is skipped with a warning that names it and says which older one the run resumes from
  instead; if none is intact, a :class:`~fira_train.run.checkpoint.CheckpointError` lists them all;
- a step number: that checkpoint, or an error naming what is wrong with it.

Either way the checkpoint's own record of the run's config (``config`` in a single-file
checkpoint's ``state.pt``, in a DCP checkpoint's ``COMPLETE``) must match the config being
resumed, up to the keys that do not change the run (``run_dir.resume_ignores``: those of
``run_dir.RESUMABLE_CHANGES``, the optimizer's implementation ``run_dir.IMPLEMENTATION_CHANGES``,
and the memory levers ``run_dir.MEMORY_LEVERS``): a mismatch
is a ``ValueError`` naming the keys, whether or not ``OUT/config.json`` is there. Checkpoints
written before the record existed are checked against ``config.json`` alone.

A checkpoint holding a pickle that would run code
(:class:`~fira_train.run.safe_load.UnsafeCheckpointError`) is refused outright: resuming does not
quietly go past it to an older one.

Under ``torchrun``, rank 0 chooses and verifies, and the other ranks take its choice (or raise
its error): every rank resumes from the same checkpoint and the files are hashed once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

import fira_optim
from fira_train.config.resolve import resolved_align_signs, saved_config
from fira_train.config.run_config import RunConfig
from fira_train.methods.registry import get_method
from fira_train.provenance import code_version, describe_change
from fira_train.run import checkpoint as ckpt
from fira_train.run import checkpoint_integrity, dist_checkpoint
from fira_train.run.launch import same_on_every_rank
from fira_train.run.run_dir import (IMPLEMENTATION_CHANGES, MEMORY_LEVERS, NOT_FROM_LAST_STEP, ROUND_OFF_LEVERS,
                                   changed_among, config_changes, describe_changes, resume_ignores)
from fira_train.run.safe_load import UnsafeCheckpointError

if TYPE_CHECKING:
    from fira_train.run.parallel import DistributedEnv

log = logging.getLogger(__name__)

#: The single-file checkpoint's key (in ``state.pt``) and the DCP marker's key for the config.
CONFIG_KEY = "config"


def check_recorded_config(recorded: Any, config: RunConfig, path: Path) -> None:
    """ValueError naming every key where ``config`` differs from the config a checkpoint
    recorded (``recorded``: its dict; None for checkpoints without the record: nothing to check)."""
    if recorded is None:
        return
    try:
        saved = saved_config(recorded)
    except (ValueError, TypeError) as err:
        raise ckpt.CheckpointError(f"checkpoint {str(path)!r} has an unreadable config record: {err}") from None
    changes = config_changes(saved, config, resume_ignores(config))
    if changes:
        details = describe_changes(saved, config, changes)
        raise ValueError(f"cannot resume from {str(path)!r}: it was written with a different config: "
                         f"{details}; resume with the checkpoint's settings, or start a new run "
                         "(another --out, or --overwrite)")
    at_end = changed_among(saved, config, NOT_FROM_LAST_STEP)
    if at_end and ckpt.checkpoint_step(path) >= config.train.steps:
        # nothing would train with them, and the finished run would be recorded (and reused:
        # finished_with) as one trained with them, its summary giving the memory and speed of
        # loading and evaluating it
        raise ValueError(f"cannot resume from {path.name} with {describe_changes(saved, config, at_end)}: it is the "
                         f"run's last step (train.steps={config.train.steps}), so nothing would train with them and "
                         "the finished run would be recorded as trained with them (its summary giving the memory of "
                         "loading and evaluating it); to train the run with these settings, train it again "
                         "(--overwrite, or another --out)")


#: The checkpoint's record of the processes that wrote it: the torch threads each used and the
#: world size, which ``train.num_threads=0`` (torch's default count) and torchrun leave out of the config.
ENVIRONMENT_KEY = "environment"


def environment_record(config: RunConfig, world_size: int) -> dict[str, Any]:
    """``{"threads", "world_size", "device", "code"}`` of a run of ``config`` in this process: its
    threads are ``train.num_threads``, else torch's default count here (it depends on the machine
    and on ``OMP_NUM_THREADS``); its device kind (``cpu``, ``cuda``), which ``train.device=auto``
    leaves to the machine; the code that runs (:func:`fira_train.provenance.code_version`)."""
    from fira_train.run.training import resolve_device  # the model and methods: imported when needed

    return {"threads": config.train.num_threads or torch.get_num_threads(), "world_size": world_size,
            "device": resolve_device(config).type, "code": code_version()}


def warn_round_off(recorded: Any, config: RunConfig, path: Path, environment: Any = None,
                   world_size: int = 1) -> None:
    """A warning where ``config`` changes a setting of :data:`ROUND_OFF_CHANGES` against the
    checkpoint's record (checked by :func:`check_recorded_config` first), or where the same
    settings give other threads or another world size than the checkpoint's ``environment``
    record (absent in checkpoints written before it was kept). Another device kind, or other code
    than the checkpoint's, is a warning of its own."""
    if recorded is None:
        return
    saved = saved_config(recorded)
    rounded = [key for key in config_changes(saved, config, ignore=frozenset()) if key in ROUND_OFF_CHANGES]
    changes = [describe_changes(saved, config, rounded)] if rounded else []
    if isinstance(environment, dict):
        now = environment_record(config, world_size)
        changes += [f"{name.replace('_', ' ')} {now[name]} (the checkpoint's: {environment[name]})"
                    for name in ("threads", "world_size")
                    if isinstance(environment.get(name), int) and environment[name] != now[name]
                    and not (name == "threads" and "train.num_threads" in rounded)
                    and not (name == "world_size" and "train.parallel" in rounded)]
        if isinstance(environment.get("device"), str) and environment["device"] != now["device"]:
            log.warning("resuming from %s on %s, where the checkpoint trained on %s%s: the run goes on, but not "
                        "as it would have there", path.name, now["device"], environment["device"],
                        " (under train.precision=auto another precision too: bf16 autocast on CUDA, fp32 on the "
                        "CPU)" if config.train.precision == "auto" else "")
        if "code" in environment:  # checkpoints written before the record: nothing to compare
            code_change = describe_change(environment["code"])
            if code_change:
                log.warning("resuming from %s, written by other code (%s): a fix made since may change "
                            "the run from here on", path.name, code_change)
    if changes:
        # only where the run projects with raw SVD signs: aligned signs, a method without
        # projections, or a random or randomized projector (a variant's own wins) have no SVD
        # basis vector to flip
        projector = fira_optim.VARIANTS.get(config.optim.method, {}).get("projector", config.optim.projector)
        flips = (get_method(config.optim.method).reads("optim.align_signs")
                 and resolved_align_signs(config) is False and projector == "svd")
        log.warning("resuming from %s with %s: the run goes on equal to round-off, not bit for bit (another "
                    "summation order)%s. Resume with the checkpoint's setting for an exact continuation",
                    path.name, ", ".join(changes),
                    "; with raw SVD signs (optim.align_signs=false) round-off can flip a basis vector, and the "
                    "runs then agree in distribution only" if flips else "")


def lever_changes(recorded: Any, config: RunConfig, path: Path) -> list[str]:
    """The :data:`~fira_train.run.run_dir.MEMORY_LEVERS` that ``config`` changes against the
    checkpoint's record (already checked by :func:`check_recorded_config`: the other keys are the
    same, and none is changed from the run's last step), each warned of: the weights go on as
    before, and the run's peak memory counts from this sitting on (the caller starts it afresh)."""
    if recorded is None:
        return []
    saved = saved_config(recorded)
    changed = changed_among(saved, config, MEMORY_LEVERS)
    if not changed:
        return []
    described = describe_changes(saved, config, changed)
    exact = ("the same sequences go through each step in other micro-batches: the weights go on equal to "
             "round-off, not bit for bit" if any(key in ROUND_OFF_LEVERS for key in changed)
             else "the weights go on as they would have (bit for bit in one process)")
    log.warning("resuming from %s with %s: %s; the run's peak memory (summary.json) counts from this sitting on",
                path.name, described, exact)
    return changed


#: Settings a resume may change at the price of round-off (the same batches, summed in another order).
ROUND_OFF_CHANGES = ("train.num_threads", "train.parallel", *IMPLEMENTATION_CHANGES)


def check_stream_cut(stream: Any, config: RunConfig, path: Path) -> None:
    """ValueError unless ``train.batch_size`` is made of whole batches of the checkpoint's data
    stream state ``stream`` (its ``batch_size``: the step it cut its epochs in, or the first
    sitting's micro-batch size in runs saved before). The stream takes the saved cut, so only a
    checkpoint without a config record (older ones) could resume at another step size: it
    stopped only at its next save, steps later."""
    cut = stream.get("batch_size") if isinstance(stream, dict) else None
    if isinstance(cut, int) and cut > 0 and config.train.batch_size % cut:
        raise ValueError(f"cannot resume from {str(path)!r}: its data stream was cut in batches of {cut} "
                         f"sequences, which train.batch_size={config.train.batch_size} cannot continue; resume with "
                         "the train.batch_size it was trained with")


def check_one_process_checkpoint_mode(path: Path, mode: str) -> None:
    """ValueError for a one-process (single-file) checkpoint resumed under FSDP2 (``mode``:
    ``train.parallel``), which loads only DCP checkpoints: refused when the checkpoint is chosen,
    before ``config.json`` is rewritten or a model built, not when it is loaded."""
    if mode == "fsdp2":
        raise ValueError(f"checkpoint {str(path)!r} was written by a one-process run; FSDP2 resumes "
                         "only from checkpoints of a --parallel run (resume it with --parallel ddp, "
                         "whose checkpoints FSDP2 can load)")


def check_checkpoint(out: Path, path: Path, config: RunConfig, *, keep_state: bool = True,
                     world_size: int = 1, warn: bool = True) -> tuple[dict | None, list[str]]:
    """Verify the checkpoint at ``path`` and its config record; returns the single-file
    checkpoint's loaded state (if ``keep_state``; None for a DCP checkpoint, loaded later, in
    place) and the memory levers the resume changes (:func:`lever_changes`; [] without ``warn``,
    which leaves out the warnings of a resume that goes on). Raises CheckpointError if it is
    damaged, UnsafeCheckpointError if it would run code, ValueError if it belongs to another config."""
    if dist_checkpoint.is_dcp_checkpoint(path):
        marker = checkpoint_integrity.read_marker(path)
        check_recorded_config(marker.get(CONFIG_KEY), config, path)
        checkpoint_integrity.verify_dcp_checkpoint(path, marker)
        if not warn:
            return None, []
        # once intact: not for a damaged one skipped
        warn_round_off(marker.get(CONFIG_KEY), config, path, marker.get(ENVIRONMENT_KEY), world_size)
        return None, lever_changes(marker.get(CONFIG_KEY), config, path)
    # size, SHA-256, weights_only; mapped where only its records are read (a sweep's check of
    # every run before it starts held each run's whole state in memory, one at a time)
    state = ckpt.load_checkpoint(out, path, mmap=not keep_state)
    check_recorded_config(state.get(CONFIG_KEY), config, path)
    check_one_process_checkpoint_mode(path, config.train.parallel)
    check_stream_cut(state.get("data"), config, path)
    if not warn:
        return None, []
    warn_round_off(state.get(CONFIG_KEY), config, path, state.get(ENVIRONMENT_KEY), world_size)
    return (state if keep_state else None), lever_changes(state.get(CONFIG_KEY), config, path)


def _choose(out: Path, resume: str | int, config: RunConfig, keep_state: bool,
            world_size: int = 1, warn: bool = True) -> tuple[Path | None, dict | None, list[str]]:
    if resume != "latest":
        path = ckpt.find_checkpoint(out, int(resume))
        return (path, *check_checkpoint(out, path, config, keep_state=keep_state, world_size=world_size, warn=warn))
    damaged: list[tuple[Path, ckpt.CheckpointError]] = []
    for _, path in reversed(ckpt.complete_checkpoints(out)):
        try:
            state, levers = check_checkpoint(out, path, config, keep_state=keep_state, world_size=world_size,
                                             warn=warn)
        except UnsafeCheckpointError:
            raise
        except ckpt.CheckpointError as err:
            damaged.append((path, err))
            continue
        if damaged and warn:
            names = ", ".join(p.name for p, _ in damaged)
            log.warning("%s: %s; resuming from %s instead, the newest intact checkpoint (the steps after "
                        "it are trained again; --resume-step STEP picks another one)",
                        names, "; ".join(str(err) for _, err in damaged), path.name)
        return path, state, levers
    if damaged:
        reasons = "; ".join(f"{p.name}: {err}" for p, err in damaged)
        raise ckpt.CheckpointError(f"no intact checkpoint in {str(Path(out) / ckpt.CHECKPOINT_DIR)!r} to "
                                   f"resume from ({reasons}); restore one and pick it with --resume-step, "
                                   "or start over with --overwrite")
    return None, None, []


def choose_checkpoint(out: str | Path, resume: str | int, config: RunConfig,
                      env: DistributedEnv | None = None) -> tuple[Path | None, dict | None, list[str]]:
    """``(checkpoint directory or None, its loaded state or None, the memory levers the resume
    changes)`` for ``resume`` in ``out``.

    The state comes back for a single-file checkpoint in a one-process run (already verified
    and read); None for a DCP checkpoint or under ``torchrun``, where the checkpoint is loaded
    later by every rank. ``(None, None, [])``: ``"latest"`` and no checkpoint at all.
    """
    out = Path(out)
    if env is None or not env.distributed:
        return _choose(out, resume, config, keep_state=True)

    def decide() -> tuple[str | None, list[str]]:
        path, _, levers = _choose(out, resume, config, keep_state=False, world_size=env.world_size)
        return (None if path is None else str(path)), levers

    path, levers = decided_on_rank_zero(env, decide)
    return (None if path is None else Path(path)), None, list(levers)


def checkpoint_refusal(out: str | Path, config: RunConfig) -> str | None:
    """Why ``--resume`` would refuse to go on from the checkpoint it chooses in ``out`` (the newest
    intact one): :func:`choose_checkpoint`'s own check of that checkpoint's config record, its
    error's text; None where it goes on (or there is no checkpoint). Without the warnings of a
    resume that goes on: the run's own process gives them. None too where no checkpoint is intact
    (or one is unsafe): the run's own process raises that error, so that a sweep's other runs
    still train (and a comparison's methods before it), as before this check was made."""
    try:
        _choose(Path(out), "latest", config, keep_state=False, warn=False)
    except ValueError as err:
        return str(err)
    except ckpt.CheckpointError:
        return None
    return None


def decided_on_rank_zero(env: DistributedEnv, decide: Callable[[], Any]) -> Any:
    """``decide()`` run by rank 0 alone (what only one process may read or change in the run
    directory) and its result, plain values, handed to every rank; an error rank 0 meets is
    raised on every rank (the others would otherwise wait in the broadcast until the timeout),
    marked :func:`~fira_train.run.launch.same_on_every_rank` (one error: rank 0 prints it)."""
    import torch.distributed as dist

    message: list[Any] = [None]
    error: BaseException | None = None
    if env.is_main:
        try:
            result = decide()
            message[0] = ("ok", str(result) if isinstance(result, Path) else result)
        except Exception as err:  # noqa: BLE001 -- handed to every rank, then re-raised here
            error = err
            message[0] = ("error", checkpoint_integrity.sendable(err))
    dist.broadcast_object_list(message, src=0, device=env.device)
    if message[0][0] == "error":
        with same_on_every_rank():  # rank 0's error, raised by every rank alike
            raise error if error is not None else message[0][1]
    return message[0][1]
