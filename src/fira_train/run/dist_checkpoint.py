"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): sharded, reshardable, atomic.

A checkpoint is a directory ``RUN/step_00000100/`` holding DCP's files (each rank writes its
own shards, rank 0 the ``.metadata``) and a ``COMPLETE`` marker. It holds the model, the
optimizer (Fira's state included: DTensors under FSDP2, plain tensors otherwise), the LR
scheduler, a dictionary of plain values for the training loop (data position, step) and
every rank's RNG states. Because DCP stores each tensor with its global shape, a checkpoint
written at one world size (or parallel mode) loads at another.

Atomic: everything is written into ``RUN/.tmp-step_00000100/``; only after every rank has
finished and the files are synced does rank 0 write the marker and rename the directory into
place. A kill at any moment leaves either the complete new checkpoint or none, and the
previous ones untouched; :func:`latest_checkpoint` ignores temporary and unmarked folders.
Every rank writes into that one folder, so on several machines it must be on a file system they
share: rank 0 checks that it sees every rank's files before it marks the folder, and a failure
there (or a full disk as it writes the marker) is raised on every rank, none left waiting.

A save that fails with an error (a full disk as any rank writes its shards, or as rank 0 writes
the marker) removes the temporary folder: rank 0, which made it, removes it once the failure is
one that every rank raises (DCP gathers each rank's outcome of the write; the steps after it are
raised on every rank), so no rank still writes into it. A rank that fails alone before the write
ends (a lost peer, a signal under ``torchrun``) leaves the folder, which the next resume removes
(:func:`fira_train.run.checkpoint.remove_partial`), as after a kill.

Non-tensor values are read back with ``torch.load(weights_only=True)`` (DCP's default
planner would unpickle arbitrary objects), and ``.metadata`` with a restricted unpickler
(:class:`fira_train.run.safe_load.SafeFileSystemReader`; DCP's reader unpickles it with plain
``pickle``). The marker records the size and SHA-256 of every file
(:mod:`fira_train.run.checkpoint_integrity`), checked before loading.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fira_optim import precision
from fira_train.files import fsync_dir, parse_json, read_regular_text, write_synced
from fira_train.run import checkpoint as ckpt
from fira_train.run import checkpoint_integrity
from fira_train.run.parallel import world_size
from fira_train.run.rng import rank_rng_state, set_rank_rng_state
from fira_train.run.safe_load import SafeFileSystemReader, UnsafeCheckpointError, unsafe_pickle_error

MARKER = ckpt.MARKER
#: ``"format"`` in the marker's JSON: tells these checkpoints from single-file ones that use the
#: same ``step_XXXXXXXX/COMPLETE`` layout (``fira_train.run.checkpoint``).
FORMAT = "torch.distributed.checkpoint"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """``RUN/step_XXXXXXXX``: where the checkpoint of ``step`` lives."""
    return Path(run_dir) / ckpt.checkpoint_name(step)


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint whose write finished (it has the marker)."""
    return (Path(path) / MARKER).is_file()


def is_dcp_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete checkpoint written by :func:`save_checkpoint`."""
    try:
        return parse_json(read_regular_text(Path(path) / MARKER)).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``run_dir``, oldest first (partial ones are ignored)."""
    return [path for _, path in ckpt.marked_step_dirs(run_dir) if path.is_dir()]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``run_dir``, or ``None``."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    *,
    keep_last: int | None = None,
    record: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically; every rank must call this.

    ``model`` is the model as trained (DDP wrapper, FSDP2 module or plain), ``optimizer`` any
    torch optimizer over its parameters, ``scheduler`` anything with ``state_dict`` /
    ``load_state_dict``, ``extra`` plain values (ints, floats, strings, lists, dicts: the
    data position, the step, config hashes). ``keep_last`` deletes older complete checkpoints
    beyond the newest ``keep_last``. ``record``: plain values added to the marker (the run's
    config, checked on resume). Returns the checkpoint directory.
    """
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(".tmp-" + final.name)
    rank = _rank()
    error: Exception | None = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # left over by a killed write
            tmp.mkdir(parents=True)
        except Exception as err:  # noqa: BLE001 -- a full disk: raised on every rank below
            error = err
    checkpoint_integrity.raise_on_every_rank(error)
    # whether a failure below is raised on every rank, none of which still writes into ``tmp``
    every_rank = world_size() == 1
    try:
        state = _state(model, optimizer, scheduler, extra, save=True)
        try:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
        except CheckpointException as err:
            every_rank = True  # DCP gathered every rank's outcome and raises on each
            raise _save_failure(err) from err
        _barrier()  # every rank's shards are on disk
        every_rank = True  # from here on, ranks only read ``tmp``, and each failure is raised on every rank
        files = checkpoint_integrity.collect_records(tmp, rank, world_size())  # every rank hashes its own
        if rank == 0:
            try:
                _check_all_shards_here(tmp, files)
                info = {**(record or {}), "format": FORMAT, "step": step, "world_size": world_size(),
                        "time": time.time(), checkpoint_integrity.FILES_KEY: files}
                write_synced(tmp / MARKER, lambda f: json.dump(info, f), binary=False)
                fsync_dir(tmp)
                ckpt.install_dir(tmp, final)
                fsync_dir(final.parent)
                if keep_last is not None:
                    prune_checkpoints(run_dir, keep_last)
            except Exception as err:  # noqa: BLE001 -- raised on every rank below
                error = err
        checkpoint_integrity.raise_on_every_rank(error)  # in place of a barrier: no rank waits for rank 0
    except BaseException:
        if rank == 0 and every_rank:  # its owner, once no rank writes there
            ckpt.discard_partial(tmp)
        raise
    return final


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (at any world size) in place.

    Restores the model, the optimizer, the scheduler and this rank's RNG states (rank 0's
    when the checkpoint had fewer ranks); returns the ``extra`` dictionary. Raises
    ``FileNotFoundError`` for a missing directory, ``ValueError`` for an incomplete one or one
    DCP cannot load (another model, a pickle that is not plain data),
    :class:`~fira_train.run.checkpoint.CheckpointError` for a damaged one (a file whose size or
    SHA-256 differs from the marker's record, an empty or truncated ``.metadata``) and
    :class:`~fira_train.run.safe_load.UnsafeCheckpointError` for a ``.metadata`` that would run
    code: nothing is read from such a checkpoint. ``verify=False`` skips the hashes (the caller
    checked them: :func:`fira_train.run.checkpoint_integrity.verify_dcp_checkpoint`); ``.metadata`` is
    always parsed safely. DCP reads tensors in place: after a failed load the model may be
    partly overwritten, so load another checkpoint or restart.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not is_complete(path):
        raise ValueError(f"checkpoint {path} is incomplete (no {MARKER} marker): its write was interrupted")
    metadata = checkpoint_integrity.verify_dcp_checkpoint(path) if verify else None
    reader = SafeFileSystemReader(str(path), metadata=metadata)  # DCP never unpickles .metadata itself
    saved_keys = set(reader.read_metadata().state_dict_metadata)
    try:
        state = _state(model, optimizer, scheduler, None, save=False, saved_keys=saved_keys)
        dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner())
    except CheckpointException as err:  # a BaseException in DCP: make it an ordinary error
        failures = [exc for exc, _ in err.failures.values()]
        for exc in failures:  # Ctrl-C, or no memory for the state: not a damaged checkpoint
            if isinstance(exc, (KeyboardInterrupt, MemoryError)):
                raise exc from None
        for exc in failures:  # a value that would run code: say so, in one line
            unsafe = exc if isinstance(exc, UnsafeCheckpointError) else unsafe_pickle_error(exc, path)
            if unsafe is not None:
                raise unsafe from None
        cause = f"{type(failures[0]).__name__}: {failures[0]}" if failures else str(err)
        raise ValueError(f"checkpoint {path} could not be loaded (corrupt, unsafe or from a "
                         f"different model): {' '.join(cause.split())}") from err
    return state["run"].loaded_extra


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; returns what was deleted.
    The newest complete checkpoint is never deleted."""
    return ckpt.delete_oldest(list_checkpoints(run_dir), keep_last)


# ---------------------------------------------------------------------- the saved state


def _state(model, optimizer, scheduler, extra, *, save: bool, saved_keys: set[str] | None = None):
    """The DCP state dict: Stateful objects that DCP asks for their state when saving and
    hands the loaded values to when loading."""
    return {
        "app": _ModelAndOptimizer(model, optimizer, saved_keys),
        "run": _RunState(scheduler, extra, saved_keys),
    }


class _ModelAndOptimizer:
    """Model and optimizer through DCP's state-dict helpers (FQN keys, DTensors resharded).

    Loading, DCP's helper first gives every parameter an optimizer state (a step on zero
    gradients) and then asks the checkpoint for all of them. A parameter that had no state when
    the checkpoint was saved (no gradient in any step before it) is left out of that request,
    so it loads with no state, as it was saved (torch's own request failed: a missing key).

    An int8 second moment saved in the value coding of earlier versions is asked for under its
    saved scale's name; the optimizer's load converts it, as it does a single-file checkpoint's."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, saved_keys: set[str] | None = None):
        self.model, self.optimizer, self.saved_keys = model, optimizer, saved_keys
        self.stateless: set[str] = set()  # loading: the parameters (names) saved without a state

    def state_dict(self) -> dict[str, Any]:
        with self._step_outside_backward():
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
        if self.saved_keys is not None:
            _ask_for_value_coded(optim_state, self.saved_keys)
            held = [name for group in optim_state["param_groups"] for name in group["params"]]
            saved = _saved_state_owners(self.saved_keys, held)
            unasked = sorted(saved - set(optim_state["state"]))
            if unasked:  # DCP would leave them out without a word
                raise ValueError(
                    f"the checkpoint holds an optimizer state for {unasked[0]!r}"
                    f"{f' (and {len(unasked) - 1} more)' if len(unasked) > 1 else ''} that this optimizer has no "
                    "place for: it does not hold that parameter, or it has stepped or holds gradients (load into "
                    "an optimizer that has not stepped, before the first backward pass)")
            self.stateless = {name for name in optim_state["state"] if name not in saved}
            optim_state["state"] = {name: entry for name, entry in optim_state["state"].items() if name in saved}
        return {"model": model_state, "optimizer": optim_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._step_outside_backward():
            set_model_state_dict(self.model, state["model"])
            options = None
            if self.stateless:
                # a parameter of the saved optimizer that had no state yet loads without one; torch
                # refuses that unless told, and then would not refuse one the saved optimizer lacked
                held = {name for group in state["optimizer"]["param_groups"] for name in group["params"]}
                outside = sorted(self.stateless - held)
                if outside:
                    raise ValueError(f"the checkpoint's optimizer does not hold {outside[0]!r}"
                                     f"{f' (and {len(outside) - 1} more)' if len(outside) > 1 else ''}: it was "
                                     "saved by an optimizer over other parameters")
                options = StateDictOptions(strict=False)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)

    def _step_outside_backward(self) -> contextlib.AbstractContextManager:
        """DCP builds missing optimizer state by a step on zero gradients: with updates in the
        backward pass that step must update every parameter (``StepInBackward.paused``)."""
        handle = getattr(self.optimizer, "in_backward", None)
        return handle.paused() if handle is not None else contextlib.nullcontext()


#: What the optimizer's state keys in a checkpoint begin with: ``app.optimizer.state.FQN.KEY``.
_STATE = "app.optimizer.state."


def _saved_state_owners(saved_keys: set[str], held: list[str]) -> set[str]:
    """The parameters whose optimizer states the checkpoint holds. A state key is
    ``app.optimizer.state.FQN.KEY`` (``...FQN.KEY.INNER`` for the nested states of some
    optimizers, apollo's projector): its owner is the longest parameter name of ``held`` that it
    continues, else its name without the last part (a parameter the loading optimizer does not hold)."""
    names = set(held)
    owners = set()
    for key in saved_keys:
        if not key.startswith(_STATE):
            continue
        parts = key[len(_STATE):].split(".")
        prefixes = (".".join(parts[:end]) for end in range(len(parts) - 1, 0, -1))
        owners.add(next((name for name in prefixes if name in names), ".".join(parts[:-1])))
    return owners


def _ask_for_value_coded(optim_state: dict[str, Any], saved_keys: set[str]) -> None:
    """Rename, in the state DCP loads into, each int8 second moment's scale that the checkpoint
    holds under the value coding's name (``exp_avg_sq_scale``, fira-optim before square-root
    coding) instead of today's (``exp_avg_sq_root_scale``): DCP then reads it (the two have one
    shape) and :meth:`fira_optim.Fira.load_state_dict` converts the moment. Without it DCP
    refused the checkpoint for a missing key."""
    for fqn, entry in optim_state.get("state", {}).items():
        prefix = f"{_STATE}{fqn}."
        for key in precision.ROOT:
            root, value = f"{key}_root_scale", f"{key}_scale"
            if root in entry and prefix + root not in saved_keys and prefix + value in saved_keys:
                entry[value] = entry.pop(root)


class _RunState:
    """Scheduler, the training loop's plain values, and each rank's RNG states.

    ``extra`` travels as one JSON string: on load its keys are not known in advance, and DCP
    loads only the keys that the loading side asks for.
    """

    def __init__(self, scheduler: Any, extra: dict[str, Any] | None, saved_keys: set[str] | None):
        self.scheduler = scheduler
        self.extra_json = json.dumps(dict(extra or {}))
        self.loaded_extra: dict[str, Any] = {}
        self.saved_keys = saved_keys
        # Loading at a larger world size: ranks the checkpoint did not have take rank 0's RNG.
        rank = _rank()
        self.rng_key = f"rank{rank}"
        if saved_keys is not None and f"run.rng.rank{rank}.torch" not in saved_keys:
            self.rng_key = "rank0"

    def state_dict(self) -> dict[str, Any]:
        rng = rank_rng_state()
        if self.saved_keys is not None:  # loading: ask only for what was saved (CPU vs CUDA)
            saved = {key.split(".")[3] for key in self.saved_keys
                     if key.startswith(f"run.rng.{self.rng_key}.")}
            rng = {k: v for k, v in rng.items() if k in saved}
        return {
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "extra_json": self.extra_json,
            "rng": {self.rng_key: rng},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.loaded_extra = json.loads(state["extra_json"])
        set_rank_rng_state(state["rng"][self.rng_key])


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor values load with ``weights_only=True``."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# ---------------------------------------------------------------------- helpers


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _check_all_shards_here(tmp: Path, files: dict[str, Any]) -> None:
    """ValueError unless rank 0 sees every file the ranks wrote into ``tmp``.

    Every rank writes its shards into the same folder, so ``OUT`` must be on a file system that
    every machine of the launch shares. On a disk of each machine's own (``--out runs/x`` on
    each) the other machines' shards land in their own ``.tmp-step_*`` folders, and rank 0
    marked its own folder complete without them: the run went on, and every checkpoint failed
    its check only at ``--resume``, missing files. Each name is looked up (a stat, which a
    network file system answers from the server for a name not looked up before), not read
    off a listing that may be cached."""
    unseen = sorted(name for name in files if not (tmp / name).is_file())
    if unseen:
        raise ValueError(
            f"rank 0 does not see {len(unseen)} checkpoint file(s) that other ranks wrote into {str(tmp)!r} "
            f"(e.g. {unseen[0]!r}): train.out_dir must be a folder that every machine of the torchrun "
            "launch shares (a network or cluster file system), not a disk of each machine's own")


def _save_failure(err: CheckpointException) -> BaseException:
    """What a failed ``dcp.save`` raises on every rank: the failure of the lowest rank that
    failed (an ``OSError`` for a full disk, with its errno and file; a ``KeyboardInterrupt`` for
    Ctrl-C), not DCP's wrapper.

    DCP gathers each rank's failure and raises the same ``CheckpointException`` on every rank;
    it derives from ``BaseException``, so ``except Exception`` (the command line's one-line
    errors, :mod:`fira_train.user_errors`) let it through as a traceback on every rank, also
    for a full disk. The ranks all raise the same error, so none is left in a collective."""
    failures = [err.failures[rank][0] for rank in sorted(err.failures)]
    ordinary = [exc for exc in failures if isinstance(exc, (Exception, KeyboardInterrupt))]
    return ordinary[0] if ordinary else err
