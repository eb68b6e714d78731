"""One line on stderr, not a traceback, for what users do and what their machine does to a run.

:func:`fira_train.cli.main` runs a command and, when it raises, asks :func:`describe` for a
message; it prints ``fira-train COMMAND: error: MESSAGE`` and exits with status 1. An exception
that :func:`describe` does not know (``None``) is a bug and keeps its traceback; so does every
exception when the environment variable ``FIRA_TRACEBACK=1`` is set (for debugging).

Known, with what the message says:

- a ``ModuleNotFoundError`` for a package of fira-optim's ``train`` extra
  (:data:`TRAIN_EXTRA_MODULES`; ``pip install fira-optim`` installs the library alone): that
  the harness needs ``pip install 'fira-optim[train]'``;
- ``ValueError`` (bad options, overrides, data, damaged JSON files: :mod:`fira_train.files`),
  ``FileNotFoundError`` / ``FileExistsError`` raised by the harness, ``CheckpointError``: their
  own message, which names the value or file;
- an ``OSError`` from the operating system (it has an ``errno``): a full disk (``ENOSPC``),
  a folder that cannot be written (``EACCES``, ``EPERM``, ``EROFS``), a file where a folder is
  needed (``ENOTDIR``, ``EEXIST``), ...: the file (standard output where that was written:
  :func:`fira_train.cli.main` marks its errors), and what to do -- for the cache
  (``$FIRA_CACHE`` or ``data.cache_dir``) set another folder, for the run folder pass another
  ``--out`` (for a temporary file: ``TMPDIR``), for a full disk free space and run the command
  again (with ``--resume``: the checkpoints already written stay; not for a new run stopped while
  its data was built, whose output folder may hold an earlier run), also where it stands behind
  another error (torch.save's writer raises a ``RuntimeError`` for it), and for a file-size limit
  (``EFBIG``) raise it;
  other ``OSError`` (a tokenizer that cannot be loaded): their message;
- a run's process that ended without a result (``IsolatedRunDied``: compare's, a sweep's or an
  analysis's run, killed by a user, a scheduler or the out-of-memory killer): how it ended, and how
  the same command goes on from what is kept;
- under ``torchrun``, a collective whose peer is gone (gloo's "Connection closed by peer", NCCL's
  "remote process exited"): that another process stopped, and that its own error says why;
- under ``torchrun``, a collective that waited for a peer longer than the process group's timeout
  (gloo's "Timed out waiting 5000ms", NCCL's watchdog), or the join of the group that did (the
  store's "wait timeout after 5000ms"): how long, that ``train.dist_timeout_s`` sets it, and that
  the peer hung or was slower;
- divergence (:class:`fira_train.run.divergence.DivergedError`, ``NonFiniteLossError``,
  ``fira_optim.NonFiniteGradientError``): that the run diverged, and what to change;
- an allocation that failed (``MemoryError``, numpy's included; torch's "DefaultCPUAllocator:
  can't allocate memory" / "not enough memory" ``RuntimeError``; ``torch.OutOfMemoryError``):
  how much, where in fira-train, and the settings given on the command line that size it
  (``model.hidden_size=...``, ``--samples``, ...) to lower.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import tempfile
from pathlib import Path

__all__ = ["TRACEBACK_ENV", "TRAIN_EXTRA_MODULES", "describe", "missing_extra"]

#: Set to 1 to get the traceback of every error instead of one line.
TRACEBACK_ENV = "FIRA_TRACEBACK"

#: The top-level modules of the ``train`` extra's packages that fira_train imports (torch, the
#: library's own dependency, aside); tests/test_packaging.py checks them against the imports
#: and pyproject.toml.
TRAIN_EXTRA_MODULES = frozenset({
    "accelerate", "adam_mini", "apollo_torch", "datasets", "flora_opt", "gguf", "lm_eval", "matplotlib", "numpy",
    "peft", "scipy", "tensorboard", "tokenizers", "tqdm", "transformers",
})

_FULL = {errno.ENOSPC, errno.EDQUOT}
#: A full disk, or a file-size limit (``ulimit -f``, the file system's largest file).
_NO_ROOM = _FULL | {errno.EFBIG}
_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}
_NOT_A_FOLDER = {errno.ENOTDIR, errno.EEXIST}


def describe(err: BaseException, args: argparse.Namespace | None = None) -> str | None:
    """The one-line message for ``err`` raised by the command ``args``; None for a bug."""
    if os.environ.get(TRACEBACK_ENV, "").strip() not in ("", "0"):
        return None
    message = missing_extra(err)
    if message is None:
        message = _describe(err, args or argparse.Namespace())
    return None if message is None else " ".join(message.split())  # one line


def missing_extra(err: BaseException) -> str | None:
    """What to install when ``err`` is the import of a package of the ``train`` extra that is not
    installed (the wheel always holds fira_train, its dependencies come with the extra); None
    for any other error."""
    name = err.name if isinstance(err, ModuleNotFoundError) else None
    top = (name or "").split(".")[0]
    if top not in TRAIN_EXTRA_MODULES:
        return None
    return (f"the package {top!r} is not installed: fira-train needs fira-optim's [train] extra "
            "(pip install 'fira-optim[train]', or pip install -e \".[train]\" in a checkout of the source); "
            "`import fira_optim` alone needs torch only")


def _describe(err: BaseException, args: argparse.Namespace) -> str | None:
    from fira_optim import NonFiniteGradientError
    from fira_train.run.checkpoint import CheckpointError
    from fira_train.run.isolated import IsolatedRunDied
    from fira_train.run.launch import BEFORE_THE_RUN

    if getattr(err, BEFORE_THE_RUN, False):
        args = argparse.Namespace(**{**vars(args), "before_the_run": True})

    if isinstance(err, OSError) and err.errno is not None:
        return _os_error(err, args)
    # the harness's own errors say what they are, also where their text mentions memory
    if _out_of_memory(err, ours=(CheckpointError, IsolatedRunDied, NonFiniteGradientError)):
        return _no_memory(err, args)
    wrapped = f"{NonFiniteGradientError.__name__}: "
    if isinstance(err, RuntimeError) and wrapped in str(err):
        # raised in a DDP communication hook (optim.step_in_backward under DDP), which torch
        # re-raises as "Got the following error when running the callback: ...": the same error
        err = NonFiniteGradientError(str(err).split(wrapped, 1)[1])
    if isinstance(err, NonFiniteGradientError):
        where = str(err).split(";")[0]  # "non-finite gradient in NAME"
        levers = ("lower --lr" if getattr(args, "command", None) == "finetune"
                  else "lower optim.lr or set train.grad_clip (e.g. 1.0)")
        # not "nothing was updated": with optim.step_in_backward the matrices whose gradients were
        # complete before it were (the optimizer says so); the run ends, and none of it is saved
        return (f"the run diverged: {where}, nothing of that step was saved; {levers} and train the run again (a resume "
                f"keeps the run's settings: it would train the same steps again){_work_kept(args)}"
                f"{_start_over(args)}")
    if isinstance(err, FloatingPointError):  # DivergedError, NonFiniteLossError
        text = str(err)
        return (text if "diverged" in text else f"the run diverged: {text}") + _work_kept(args) + _start_over(args)
    if isinstance(err, IsolatedRunDied):  # killed (by a user, a scheduler, the OOM killer): how to go on
        return _run_again(str(err), "what it printed above says why; fix that if it was not stopped on purpose", args)
    if isinstance(err, (ValueError, OSError, CheckpointError)):
        return str(err)
    behind = _disk_error_behind(err)
    if behind is not None:
        return _os_error(behind, args)
    timed_out = _collective_timeout(err)
    if timed_out is not None:
        what, waited = timed_out
        return _run_again(f"{what} of this torchrun launch waited {waited} (train.dist_timeout_s) for another "
                          "process that did not answer: it hung (stopped by kill -STOP or a debugger, or stuck) "
                          "or was slower than that",
                          "find why that process stopped answering, or raise train.dist_timeout_s if it was only "
                          "slow (building the data's cache, a checkpoint)", args)
    peer = _peer_gone(err)
    if peer is not None:
        # Ctrl-C reaches the processes of a launch one after another (torchrun forwards SIGINT to
        # each in turn): one interrupted before its peers lost them first, and nothing is wrong
        return _run_again(f"another process of this torchrun launch stopped ({peer})",
                          "if it was interrupted (Ctrl-C), nothing needs fixing; else its own error, printed by "
                          "that process, says why (one killed, by kill -9 or the out-of-memory killer, printed "
                          "none: torchrun's report names its signal): fix that", args)
    return _short_write(err, args)


#: What a collective says when the process at the other end is gone: gloo's TCP pair, NCCL.
_PEER_GONE = re.compile(r"Connection (?:closed|reset) by peer|remote process exited or there was a network error")


#: What a collective says when a peer did not answer in the process group's timeout: gloo's TCP
#: pair, NCCL's watchdog; the timeout in milliseconds.
_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms for \w+ operation|"
                        r"Watchdog caught collective operation timeout.*?Timeout\(ms\)=(\d+)")
#: What joining the group says when a peer did not join in that timeout (it hung before, or started
#: that much later): the launch's store (torchrun's), waiting for the peer's address.
_JOIN_TIMED_OUT = re.compile(r"wait timeout after (\d+)ms, keys: ")


def _collective_timeout(err: BaseException) -> tuple[str, str] | None:
    """Under torchrun, a collective (or the join of the process group) that waited for a peer longer
    than ``train.dist_timeout_s`` (a peer hung, not dead): what waited and how long ("5 s"), or None."""
    if not isinstance(err, RuntimeError):
        return None
    found = _TIMED_OUT.search(str(err))
    if found is not None:
        return "a collective", f"{int(found.group(1) or found.group(2)) / 1000:g} s"
    found = _JOIN_TIMED_OUT.search(str(err))
    if found is not None:  # torch.distributed.DistStoreError's
        return "joining the process group", f"{int(found.group(1)) / 1000:g} s"
    return None


def _peer_gone(err: BaseException) -> str | None:
    """Under torchrun, the collective of a rank whose peer stopped (an error of that rank's own,
    one line there; a kill) fails with torch's traceback on every other rank, which buried
    the one line that says why; the words that say the peer went, or None."""
    text = str(err)
    if not isinstance(err, RuntimeError) or not ("gloo" in text or "NCCL" in text):  # not a network read's
        return None
    found = _PEER_GONE.search(text)
    return None if found is None else found.group(0)


#: What an allocator that found no memory says: torch on the CPU ("DefaultCPUAllocator: can't
#: allocate memory" / "not enough memory"), CUDA and MPS ("out of memory"), numpy ("Unable to
#: allocate"), also as the text of an error that came back from a child process.
_NO_MEMORY = re.compile(r"DefaultCPUAllocator|not enough memory|can't allocate memory|out of memory(?!\?)|"
                        r"Unable to allocate|(?<![\w.(])MemoryError\b")
#: How much it wanted, in the words of each: bytes (torch, CPU), a size with its unit (CUDA, numpy).
_WANTED = (re.compile(r"tried to allocate (\d+) bytes"), re.compile(r"[Tt]ried to allocate ([\d.]+ ?[KMGTPE]i?B)"),
           re.compile(r"Unable to allocate ([\d.]+ ?[KMGTPE]i?B for an array with shape \([^)]*\))"))
#: Keys of ``key=value`` overrides that size what a run allocates (a section ends in ``.``).
_SIZE_KEYS = ("model.", "train.batch_size", "train.micro_batch_size", "data.seq_len")
#: Flags that size what a command allocates.
_SIZE_FLAGS = ("--samples", "--batch-size", "--eval-batch-size", "--cutoff-len", "--max-new-tokens", "--columns",
               "--model", "--rank", "--lora-r")


def _out_of_memory(err: BaseException, ours: tuple[type, ...]) -> bool:
    """Whether ``err`` is an allocation that found no memory (not a bug: a size asked for). The
    text is read in torch's and Python's ``RuntimeError`` s (the allocators', CUDA's
    ``AcceleratorError``, an error from a run's own process), not in ``ours`` (the harness's own
    errors: a checkpoint whose metadata failed to unpickle with a MemoryError)."""
    import torch

    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(err, RuntimeError) and not isinstance(err, ours) and _NO_MEMORY.search(str(err)) is not None


def _no_memory(err: BaseException, args: argparse.Namespace) -> str:
    """Out of memory: how much was asked for, where, and the settings given that size it."""
    text = str(err)
    wanted = next((found.group(1) for pattern in _WANTED for found in [pattern.search(text)] if found), None)
    if wanted is not None and wanted.isdigit():
        wanted = _binary_size(int(wanted))
    where, given = _allocated_in(err), _sizes_given(args)
    lower = (f"lower {', '.join(given)}" if given else
             "lower what sizes it (the model: model.*; the batch: train.micro_batch_size; data.seq_len; the "
             "command's size flags)")
    return (f"out of memory: {'allocating ' + wanted if wanted else 'an allocation failed'}"
            f"{' in ' + where if where else ''} ({type(err).__name__}); {lower}, or run it where more memory is free")


def _sizes_given(args: argparse.Namespace) -> list[str]:
    """The overrides (:data:`_SIZE_KEYS`) and flags (:data:`_SIZE_FLAGS`) on the command line that
    size what it allocates, as written."""
    overrides = [item.strip() for item in getattr(args, "overrides", None) or []]
    given = [item for item in overrides for key in [item.partition("=")[0].strip()]
             if any(key.startswith(k) if k.endswith(".") else key == k for k in _SIZE_KEYS)]
    argv = list(getattr(args, "argv", None) or [])
    for word, after in zip(argv, argv[1:] + [""]):
        if word in _SIZE_FLAGS:
            given.append(f"{word} {after}")
        elif word.partition("=")[0] in _SIZE_FLAGS and "=" in word:
            given.append(word)
    return given


def _binary_size(n: int) -> str:
    """``n`` bytes in the largest binary unit from GiB on that keeps it >= 1 (as numpy says it)."""
    for power, unit in ((5, "PiB"), (4, "TiB")):
        if n >= 1024**power:
            return f"{n / 1024**power:.2f} {unit}"
    return f"{n / 2**30:.2f} GiB"


def _allocated_in(err: BaseException) -> str | None:
    """The innermost fira-train function the failed allocation was made in (none for an error that
    came back from a child process: its traceback stayed there)."""
    where, trace = None, err.__traceback__
    while trace is not None:
        name = trace.tb_frame.f_globals.get("__name__", "")
        if name.startswith("fira_train.") and name not in ("fira_train.cli", "fira_train.run.isolated"):
            where = f"{name}.{trace.tb_frame.f_code.co_name}"
        trace = trace.tb_next
    return where


#: A Rust library's I/O error (safetensors: "I/O error: No space left on device (os error 28)").
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _disk_error_behind(err: BaseException) -> OSError | None:
    """The full disk or file-size limit behind ``err``: the OSError it was raised while handling
    (torch.save's zip writer, given a file, turns it into a RuntimeError "unexpected pos ..."), or
    one a Rust library names in its message (safetensors)."""
    visited, seen = {id(err)}, err.__cause__ or err.__context__
    while seen is not None and id(seen) not in visited:  # a chain may loop
        if isinstance(seen, OSError) and seen.errno in _NO_ROOM:
            return seen
        visited.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    found = _RUST_OS_ERROR.search(str(err))
    if found and int(found.group(1)) in _NO_ROOM:
        return OSError(int(found.group(1)), os.strerror(int(found.group(1))))
    return None


def _short_write(err: BaseException, args: argparse.Namespace) -> str | None:
    """torch.save given a path (the Hugging Face Trainer's checkpoints) writes from C++, and a
    write that fails there is only "unexpected pos": a full disk, a file-size limit or an I/O
    error, it cannot tell which."""
    text = str(err)
    if not (isinstance(err, RuntimeError) and "inline_container.cc" in text and "unexpected pos" in text):
        return None
    where = _run_dir(args) or "the output folder"
    return _no_room(f"a file in {where} could not be written whole (torch.save: {text.strip()}): the disk is full, "
                    "a file-size limit (`ulimit -f`) was reached or the device failed",
                    "free some space or raise the limit", args)


def _start_over(args: argparse.Namespace) -> str:
    """How the command trains a diverged run again: ``--overwrite`` where it has the flag
    (``memory --measure`` measures each method afresh anyway); ``finetune``, whose
    ``--overwrite`` replaces results only and whose next start continues its checkpoints (or
    refuses them, with another ``--lr``), by removing them."""
    if getattr(args, "command", None) == "finetune" and hasattr(args, "save_steps"):
        folder, kept = finetune_checkpoints(args)
        return f"; remove {folder} to start it over" if kept else ""
    if getattr(args, "command", None) == "compare" and hasattr(args, "overwrite"):
        return "; --overwrite starts the comparison over, its finished methods too"  # one folder for all
    return "; --overwrite starts it over" if hasattr(args, "overwrite") else ""


def finetune_checkpoints(args: argparse.Namespace) -> tuple[Path | None, bool]:
    """``finetune``'s checkpoint folder (``OUT/trainer``; None for a run that trains nothing) and
    whether it holds a checkpoint the same command continues from."""
    from fira_train.finetune.checkpoints import has_checkpoint  # only for finetune
    from fira_train.finetune.cli import checkpoint_folder

    folder = checkpoint_folder(args)
    return folder, folder is not None and has_checkpoint(folder)


#: What the same command takes to continue after it stopped (for want of room, or stopped by the
#: user: :func:`fira_train.cli.interrupted_hint`), keeping what it made.
CONTINUES_WITH = {"pretrain": "--resume", "compare": "--resume", "analyze": "--reuse", "sweep": "--reuse",
                  "memory": "--append, its --methods cut to those not measured yet"}


def _run_again(problem: str, fix: str, args: argparse.Namespace) -> str:
    """The one line for a command that stopped and can go on: what happened, what to do, and
    how the same command continues, keeping what it made. A new run stopped before it wrote
    anything (:func:`before_the_run`) is started again by the same command: ``--resume`` would
    continue the earlier run its output folder may hold (finished, or of other settings)."""
    if before_the_run(args):
        return f"{problem}: {fix} and run the same command again ({nothing_written(args)})"
    flag = CONTINUES_WITH.get(getattr(args, "command", ""))
    return f"{problem}: {fix} and run the same command again{f' with {flag}' if flag else ''}" \
           f"{_work_kept(args)}"


def before_the_run(args: argparse.Namespace) -> bool:
    """Whether the command stopped before its new run wrote anything in its output folder, as its
    data was built (:data:`fira_train.run.launch.BEFORE_THE_RUN`, which :func:`describe` and the
    command line's Ctrl-C hint copy into ``args``)."""
    return bool(getattr(args, "before_the_run", False))


def nothing_written(args: argparse.Namespace) -> str:
    """What a run stopped before it began left in its output folder: nothing of its own, and
    what ``--overwrite`` would have replaced still there."""
    out = _run_dir(args) or "the output folder"
    replaced = ("; what --overwrite replaces there is not deleted yet" if getattr(args, "overwrite", False)
                else "")
    return f"the run stopped while its data was built, before it wrote anything in {out}{replaced}"


def _no_room(problem: str, fix: str, args: argparse.Namespace) -> str:
    """The one line for a write that found no room: :func:`_run_again`, or only the first part
    where nothing was made yet."""
    command = getattr(args, "command", "")
    if command == "methods" or keeps_nothing(args) or command == "memory" and not _memory_json(args).is_file():
        return f"{problem}: {fix} and run the same command again"  # nothing made, or measured: nothing kept
    return _run_again(problem, fix, args)


def keeps_nothing(args: argparse.Namespace) -> bool:
    """Whether the command keeps no work to go on from when it stops: ``analyze variance``, a
    simulation of seconds to minutes that writes its report at the end."""
    return getattr(args, "command", None) == "analyze" and getattr(args, "analysis_name", None) == "variance"


def _work_kept(args: argparse.Namespace) -> str:
    """What the command keeps of its work when it stops: checkpoints and finished runs, or
    memory's rows."""
    out = _run_dir(args)
    command = getattr(args, "command", None)
    if command == "memory":
        return f" (the methods measured so far stay in {_memory_json(args)})"
    if command == "finetune" and hasattr(args, "save_steps"):  # OUT/trainer
        folder, kept = finetune_checkpoints(args)
        if folder is None:
            return ""
        return (f" (the checkpoints already written in {folder} stay)" if kept
                else f" (no checkpoint was written in {folder} yet)")
    if no_checkpoint_yet(args):
        if command == "pretrain":
            return f" (no checkpoint was written in {out} yet)"
        return (f" (nothing was kept in {out} yet: no run finished and no checkpoint was written, so the "
                "command starts again from the beginning)")
    return f" (the checkpoints already written in {out} stay)" if out else " (the checkpoints already written stay)"


#: Where the runs of a command that trains several live in its output folder (OUT): compare's in
#: OUT/<spec>/ (:mod:`fira_train.compare`), an analysis's in OUT/<run name>/
#: (:mod:`fira_train.analysis.runs`), a sweep's in OUT/<spec>/lr=<lr>/seed=<seed>/
#: (:meth:`fira_train.sweep.grid.RunKey.folder`). pretrain's run is OUT itself.
_RUN_FOLDERS = {"compare": "*", "analyze": "*", "sweep": "*/lr=*/seed=*"}
#: What a run that ended leaves in its folder, which its command keeps: a finished run's summary
#: (compare's ``--resume``, a sweep's and an analysis's ``--reuse`` reuse it), a sweep's diverged
#: run's marker (:data:`fira_train.sweep.grid.DIVERGED_FILE`, kept as diverged).
_ENDED = ("summary.json", "diverged.json")


def no_checkpoint_yet(args: argparse.Namespace) -> bool:
    """Whether the command's output folder (``--out`` or ``train.out_dir=``, as given) holds
    nothing it would go on from: for ``pretrain``, no checkpoint (the run stopped before its
    first one, ``train.save_every``, and ``--resume`` starts it again from step 0); for
    ``compare``, ``sweep`` and ``analyze``, no checkpoint of any of their runs and no run that
    ended (finished, or a sweep's diverged one), so that the same command with ``--resume`` /
    ``--reuse`` starts again from the beginning. False where that is not known (no folder given,
    none there yet, one that cannot be read, another command)."""
    command, out = getattr(args, "command", None), _run_dir(args)
    if command != "pretrain" and command not in _RUN_FOLDERS or out is None:
        return False
    from fira_train.run.checkpoint import complete_checkpoints  # imports torch: only when needed

    try:
        if not Path(out).is_dir():
            return False
        if command == "pretrain":
            return not complete_checkpoints(out)
        runs = [run for run in Path(out).glob(_RUN_FOLDERS[command]) if run.is_dir()]
        return not any(complete_checkpoints(run) or any((run / name).exists() for name in _ENDED) for run in runs)
    except (OSError, ValueError):  # a folder that cannot be read, a checkpoint linked from outside: not known
        return False


def out_not_there(args: argparse.Namespace) -> bool:
    """Whether the output folder of a command that trains (``pretrain``, ``compare``, ``sweep``,
    ``analyze``; ``--out``, ``train.out_dir=`` or the default the command resolved) is not there:
    after Ctrl-C, a start stopped before it wrote anything (its lock removes the folder it made).
    Not for errors in general: under a multi-node launch the folder is on rank 0's machine."""
    out = _run_dir(args)
    return getattr(args, "command", None) in ("pretrain", *_RUN_FOLDERS) and out is not None \
        and not os.path.lexists(out)


def _memory_json(args: argparse.Namespace) -> Path:
    """Where ``memory --measure`` keeps its rows."""
    from fira_train.files import measure_out_dir

    return Path(measure_out_dir(getattr(args, "out", None), args.recipe), "memory.json")


def _run_dir(args: argparse.Namespace) -> str | None:
    """The command's output folder: as the command resolved it (``args.run_dir``, its default
    included, once it got that far), else as given: ``--out`` or a ``train.out_dir=`` override."""
    if getattr(args, "run_dir", None):
        return str(args.run_dir)
    given = _out_given(args)
    return given[1] if given else None


def _out_given(args: argparse.Namespace) -> tuple[str, str] | None:
    """The output folder the command line gave and how: ``--out``, or pretrain's ``train.out_dir=``
    override (the same setting); None where it gave none (a recipe's default)."""
    if getattr(args, "out", None):
        return "--out", str(args.out)
    values = [o.partition("=")[2] for o in getattr(args, "overrides", None) or [] if o.startswith("train.out_dir=")]
    return ("train.out_dir", values[-1]) if values else None


def _cache_dir(args: argparse.Namespace) -> tuple[Path, str]:
    """The cache folder the command uses and where it was set."""
    from fira_train.data.disk_cache import CACHE_ENV_VAR, default_cache_dir

    values = [o.partition("=")[2] for o in getattr(args, "overrides", None) or [] if o.startswith("data.cache_dir=")]
    if values and values[-1].strip().lower() not in ("none", "null"):
        return Path(values[-1]).expanduser(), "data.cache_dir"
    if os.environ.get(CACHE_ENV_VAR):
        return default_cache_dir(), f"${CACHE_ENV_VAR}"
    return default_cache_dir(), "the default cache folder"


def _inside(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    return path == folder or folder in path.parents


def _room_elsewhere(path: str | None, out: str | None, in_cache: bool, stream: str | None,
                    cache_setting: str) -> str | None:
    """How to put what could not be written where there is room: the setting that chose its
    place. A file name says which (the cache, by ``cache_setting``: ``data.cache_dir`` where the
    command gave it, else FIRA_CACHE; the run folder, the temporary folder; None: no setting of
    fira-train's); a library's error names none: the run folder or the cache may be the full one."""
    if stream is not None:
        return f"send {stream} to another disk"
    if path is None:
        return f"point --out or {cache_setting} at another disk"
    if in_cache:
        return f"point {cache_setting} at another disk"
    # without --out the run folders are under the current one's runs/ (recipes' out_dir)
    if _inside(path, out if out is not None else os.path.join(os.getcwd(), "runs")):
        return "point --out at another disk"
    if _inside(path, tempfile.gettempdir()):  # before the current folder, which may hold it (/tmp, /)
        return "point TMPDIR at another disk"
    if out is None and _inside(path, os.getcwd()):
        return "point --out at another disk"
    return None


def _os_error(err: OSError, args: argparse.Namespace) -> str:
    path = err.filename if err.filename is not None else None
    reason = err.strerror or os.strerror(err.errno)
    cache, cache_source = _cache_dir(args)
    out = _run_dir(args)
    in_cache = path is not None and _inside(path, cache)
    if err.errno in _NO_ROOM:
        stream = getattr(err, "stream", None)  # set by fira_train.cli.main: standard output
        where = stream or path or out or "the output folder"
        target = _room_elsewhere(path, out, in_cache, stream,
                                 "data.cache_dir" if cache_source == "data.cache_dir" else "FIRA_CACHE")
        elsewhere = f" (or {target})" if target else ""
        if err.errno in _FULL:
            return _no_room(f"no space left on the device holding {where} ({reason})",
                            f"free some space{elsewhere}", args)
        return _no_room(f"a file in {where} grew past the largest this process may write ({reason}; `ulimit -f`, or "
                        "the file system's limit)", f"raise that limit{elsewhere}", args)
    if path is None:
        return f"{reason} (in {out or 'the output folder'})"
    if in_cache:
        fix = ("set FIRA_CACHE to a folder you can write (or pass data.cache_dir=DIR)" if cache_source != "data.cache_dir"
               else "pass data.cache_dir=DIR with a folder you can write (or leave it out to use $FIRA_CACHE)")
        what = "is not a folder (a file is in the way)" if err.errno in _NOT_A_FOLDER else "cannot be written"
        return f"the cache folder {cache} ({cache_source}) {what}: {reason}: {path}; {fix}"
    if err.errno in _NOT_WRITABLE:
        fix = "pass --out with a folder you can write" if out is None or _inside(path, out) else (
            "check the permissions of that folder")
        return f"cannot write {path}: {reason}; {fix}"
    if err.errno in _NOT_A_FOLDER:
        given = _out_given(args)  # the output folder the user named, not a recipe's default
        where = f" for {given[0]} {given[1]}" if given and out is not None and _inside(out, path) else ""
        return f"{path}: {reason} (a file is where a folder is needed{where}); move it or choose another folder"
    if err.errno == errno.ENOENT and out is not None and _inside(out, path):
        # making the output folder or a folder above it, where none can be made (/proc/x); a
        # file missing inside it is another matter (read, not made)
        return f"cannot create {path} for the output folder {out}: {reason}; pass --out with a folder you can write"
    return f"{path}: {reason}"
