"""The distributed-only pieces of :func:`fira_train.run.train.train` (``train.parallel`` ddp / fsdp2).

The training loop stays one loop; what differs under ``torchrun`` lives here:

- :func:`check_launch` / :func:`distributed_session`: refuse several processes without
  ``--parallel``; join the process group (gloo on CPU, NCCL on CUDA) and leave it at the end,
  also on an error, after the DDP / FSDP2 model is released (a DDP model that outlives its
  gloo group can hang in its destructor);
- :func:`check_same_config` / :func:`check_same_data`: refuse processes given different
  settings, or reading different data;
- :func:`accumulation_context`: DDP all-reduces the gradients once per optimizer step, not
  once per micro-batch;
- :func:`eval_rows` / :func:`sum_over_ranks`: validation on this rank's rows, reduced to the
  one-process token mean;
- :func:`save` / :func:`load`: checkpoints through :mod:`fira_train.run.dist_checkpoint` (DCP)
  holding what :func:`fira_train.run.state.capture_state` holds: model, optimizer, scheduler,
  data position, step, running totals and every rank's RNG states. They use the same
  ``OUT/checkpoints/step_XXXXXXXX/COMPLETE`` layout as the one-process checkpoints, so
  :func:`fira_train.run.checkpoint.latest_checkpoint` finds both, and :func:`load` reads either.
"""

from __future__ import annotations

import contextlib
import gc
import traceback
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fira_train.config.overrides import changed_keys, flat_config
from fira_train.config.run_config import RunConfig
from fira_train.data.corpus import data_change
from fira_train.run import checkpoint as ckpt
from fira_train.run import dist_checkpoint
from fira_train.run.callbacks import TrainCallback, load_callback_states
from fira_train.run.launch import SAME_ON_EVERY_RANK, same_on_every_rank
from fira_train.run.parallel import DistributedEnv, destroy_distributed, init_distributed, world_size
from fira_train.run.resume_check import check_one_process_checkpoint_mode
from fira_train.run.state import DATA_RECORD, check_corpus, corpus_record, restore_state
from fira_train.run.training import Training

#: What a distributed checkpoint's ``extra`` holds besides the tensors DCP stores.
EXTRA_KEYS = ("step", "data", "progress")


@same_on_every_rank()  # the config and the launch's size: every process refuses it alike
def check_launch(config: RunConfig) -> None:
    """ValueError for several processes with ``train.parallel="none"``: each would train the
    whole batch alone and all would write the same files; and for a micro-batch that the
    processes cannot share. Known before anything is built or written: ``compare`` checks each
    run's config before the first one trains."""
    world = world_size()
    if config.train.parallel == "none" and world > 1:
        raise ValueError(
            f"{world} processes were launched (torchrun) but train.parallel is 'none': pass "
            "--parallel ddp or --parallel fsdp2 (or train.parallel=ddp|fsdp2), or launch one process")
    micro_batch = config.train.micro_batch
    if config.train.parallel != "none" and micro_batch % world:
        raise ValueError(f"train.micro_batch_size={micro_batch} (the sequences of one forward pass) "
                         f"must divide by the {world} processes: each trains on its rows")


@contextlib.contextmanager
def distributed_session(config: RunConfig) -> Iterator[DistributedEnv]:
    """The :class:`DistributedEnv` of a ``train.parallel`` run, inside its process group.

    Joins the group ``torchrun`` describes (or uses one that is already initialised, e.g. by
    ``compare`` or a test) and destroys it on exit only if it created it. ``train.device``
    "cpu" forces gloo on a CUDA machine; "auto" / "cuda" take ``cuda:LOCAL_RANK`` when CUDA
    is available. A group it creates waits ``train.dist_timeout_s`` in each collective (0:
    torch's default).
    """
    mode = config.train.parallel
    if config.train.device == "cuda" and not torch.cuda.is_available():
        with same_on_every_rank():  # the config on this machine: the launch's processes refuse it alike
            raise ValueError("train.device='cuda' but CUDA is not available")
    created = not (dist.is_available() and dist.is_initialized())
    env = init_distributed(device="cpu" if config.train.device == "cpu" else None,
                           timeout=config.train.dist_timeout_s or None)
    try:
        if not env.distributed:
            raise ValueError(
                f"train.parallel={mode!r} needs the processes of a torchrun launch, e.g. "
                f"torchrun --nproc_per_node 2 -m fira_train pretrain|compare ... --parallel {mode}")
        yield env
    except BaseException as err:
        # The traceback keeps the finished training frames (and their DDP / FSDP2 model)
        # alive; drop their locals so the model goes before the process group does.
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        if created:
            gc.collect()
            destroy_distributed()


#: Settings the processes of a launch may give differently: each process's own compute, not the run's,
#: and where it caches its tokenizer and tokens (a disk of each machine's own; the data the ranks
#: read is compared by :func:`check_same_data`).
PER_PROCESS_KEYS = frozenset({"train.num_threads", "data.cache_dir"})


def check_same_config(config: RunConfig, env: DistributedEnv) -> None:
    """ValueError on every rank, naming each setting and its value on each rank, where the
    processes of the launch were given different configs (a launch not made by one command line:
    a script that passes each rank its own, machines of a multi-node launch typed apart). Each
    rank trained with its own: a mismatch of the steps or the micro-batches stopped gloo with
    "collective mismatch" or hung NCCL; one of the learning rate or any other setting trained on
    silently, each replica with its own value, and the run recorded rank 0's. Known before the
    run's folder is touched; :data:`PER_PROCESS_KEYS` may differ."""
    mine = {key: value for key, value in flat_config(config).items() if key not in PER_PROCESS_KEYS}
    differences = _described(_gathered(mine, env))
    if differences:
        error = ValueError(f"the {env.world_size} processes of this launch were given different settings: "
                           f"{differences}; every process of a torchrun launch must run the same command line")
        setattr(error, SAME_ON_EVERY_RANK, True)  # each rank gathered the same: rank 0 says it for all
        raise error


def check_same_data(corpus: Any, source: str, env: DistributedEnv) -> None:
    """ValueError on every rank, naming what each rank read, where the processes of the launch
    read different data from the same ``data.source`` (``source``): machines of a multi-node
    launch each with a copy of their own, or a relative path read from another folder. Each
    rank trained on its own rows of other batches, and the checkpoints recorded rank 0's data.
    Compares the digest of its token ids, else (a streamed corpus) its fingerprint: the most
    exact record, as a resume compares a checkpoint's (:func:`fira_train.data.corpus.data_change`);
    the fingerprint also changes where only the tokenizer's file is written otherwise (another
    ``tokenizers`` release), the ids the same. Known once the corpus is built; the error names both."""
    described = corpus.describe()
    mine = {key: described.get(key) for key in DATA_RECORD if described.get(key)}
    gathered = _gathered(mine, env)
    if any(data_change(gathered[0], theirs) for theirs in gathered[1:]):
        error = ValueError(f"the {env.world_size} processes of this launch read different data from data.source="
                           f"{source!r}: {_described(gathered)}; every process must read the same corpus (on "
                           "several machines, the same files at the same path)")
        setattr(error, SAME_ON_EVERY_RANK, True)  # each rank gathered the same: rank 0 says it for all
        raise error


def _gathered(mine: dict[str, Any], env: DistributedEnv) -> list[dict[str, Any]]:
    """Every rank's ``mine``, by rank."""
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, mine)
    return gathered


def _described(gathered: list[dict[str, Any]]) -> str:
    """``"key=A on rank 0, B on ranks 1, 2; ..."`` for each key whose value differs between the
    ranks' ``gathered`` dicts, "" where none does (the same on every rank)."""
    keys = sorted({key for theirs in gathered[1:] for key in changed_keys(gathered[0], theirs)})
    described = []
    for key in keys:
        ranks: dict[str, list[int]] = {}
        for rank, theirs in enumerate(gathered):
            ranks.setdefault(repr(theirs.get(key)), []).append(rank)
        described.append(f"{key}=" + ", ".join(
            f"{value} on rank{'s' if len(where) > 1 else ''} {', '.join(map(str, where))}"
            for value, where in ranks.items()))
    return "; ".join(described)


def accumulation_context(model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """``model.no_sync()`` for a DDP model on every micro-batch but the step's last one.

    DDP would all-reduce after every backward; the sum of the accumulated local gradients is
    reduced once instead (the same average). FSDP2 keeps reduce-scattering each micro-batch:
    skipping it would hold unsharded gradients, the memory FSDP2 is there to save.
    """
    if not last and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def eval_rows(batch: torch.Tensor, env: DistributedEnv) -> tuple[torch.Tensor, bool]:
    """This rank's rows of a validation batch and whether they count.

    Validation batches need not divide by the world size (``tensor_split``: the first ranks
    get one row more). A rank left without rows runs the batch's first row and does not count
    it: under FSDP2 every rank must join every forward's all-gathers.
    """
    rows = batch.tensor_split(env.world_size)[env.rank]
    if rows.shape[0] == 0:
        return batch[:1], False
    return rows, True


def sum_over_ranks(total: torch.Tensor, count: int, env: DistributedEnv) -> tuple[torch.Tensor, int]:
    """(sum of the ranks' loss sums, sum of their token counts), reduced in float64."""
    both = torch.stack([total.double(), torch.tensor(float(count), dtype=torch.float64, device=total.device)])
    dist.all_reduce(both)
    return both[0], int(both[1].item())


def save(out: Path, step: int, training: Training, stream: Any, progress: dict[str, float],
         keep_last: int, record: dict[str, Any] | None = None) -> Path:
    """Write the DCP checkpoint of ``step`` under ``OUT/checkpoints`` (every rank calls this);
    older complete checkpoints beyond ``keep_last`` are deleted. ``record``: plain values for
    the marker (the run's config)."""
    extra = {"step": step, "data": stream.state_dict(), "progress": dict(progress),
             "loss_scale": training.loss_scale_state(), **corpus_record(stream)}
    return dist_checkpoint.save_checkpoint(Path(out) / ckpt.CHECKPOINT_DIR, step, training.model,
                                           training.optimizer, training.scheduler, extra,
                                           keep_last=keep_last, record=record)


def load(out: Path, path: Path, training: Training, stream: Any, mode: str,
         source: str, callbacks: Sequence[TrainCallback] = ()) -> tuple[int, dict[str, float]]:
    """Restore ``training``, ``stream`` and ``callbacks`` from the checkpoint at ``path``
    (``source``: ``data.source``, for an error); (step, progress). DCP checkpoints hold no
    callback state: stateful callbacks are refused there.

    A DCP checkpoint loads at any world size and parallel mode, one process included (DCP
    then reads without a process group). A one-process (single-file) checkpoint loads under
    DDP, whose parameters are the one-process model's; FSDP2 needs a DCP checkpoint.
    """
    if dist_checkpoint.is_dcp_checkpoint(path):
        with warnings.catch_warnings():
            # One process: DCP warns that it assumes a non-distributed load, which it is.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # verify=False: train() verified it when it chose it (fira_train.run.resume_check)
            extra = dist_checkpoint.load_checkpoint(path, training.model, training.optimizer,
                                                    training.scheduler, verify=False)
        missing = [key for key in EXTRA_KEYS if key not in extra]
        if missing:
            raise ckpt.CheckpointError(f"checkpoint {str(path)!r} lacks {missing}")
        check_corpus(extra, stream, source)
        load_callback_states(callbacks, None)
        stream.load_state_dict(extra["data"])
        training.load_loss_scale_state(extra.get("loss_scale"))
        return int(extra["step"]), dict(extra["progress"])
    check_one_process_checkpoint_mode(path, mode)  # refused before, as the checkpoint was chosen
    return restore_state(ckpt.load_checkpoint(out, path), training, stream, source, callbacks)
