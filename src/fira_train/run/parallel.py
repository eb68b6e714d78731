"""Data parallelism applied to a built model: DDP or FSDP2 (torchtitan's ``parallelize`` pattern).

The model code knows nothing about parallelism. A training script builds the model, calls
:func:`parallelize` once, builds the optimizer from the returned model's parameters (FSDP2
replaces them by DTensors), and feeds each rank its rows of every global batch
(:func:`shard_batch`), so a run at any world size sees the same global batches as a
one-process run::

    env = init_distributed()                       # reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK
    model = build_model(config).to(env.device)
    model = parallelize(model, "fsdp2", env)       # or "ddp" / "none"
    optimizer = FiraAdamW(param_groups(unwrap(model), ...), ...)
    for batch in batches:                          # the same global batch on every rank
        loss = model(shard_batch(batch, env)) ...

Launch with ``torchrun --nproc_per_node N -m fira_train ...`` (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from fira_train.config.run_config import PARALLEL_MODES
from fira_train.run.launch import launched_world_size


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits: its global rank, the world size, its rank on the machine and
    its device. ``backend`` is ``None`` for a one-process run (no process group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, prints and writes run-level files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def init_distributed(backend: str | None = None, device: str | torch.device | None = None,
                     timeout: float | None = None) -> DistributedEnv:
    """Join the process group that ``torchrun`` set up, or describe a one-process run.

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``. Without them (plain ``python``) no
    process group is created. ``backend`` defaults to NCCL when CUDA is available, else gloo;
    ``device`` to ``cuda:LOCAL_RANK`` or CPU. ``timeout``: seconds a collective waits for the
    other processes before it fails (a hung peer); None keeps torch's default (30 minutes for
    gloo, 10 for NCCL). A group that is already initialised keeps its own.
    """
    world_size = launched_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_available() and dist.is_initialized():
        return DistributedEnv(dist.get_rank(), dist.get_world_size(), local_rank, device,
                              dist.get_backend())
    if "RANK" not in os.environ and world_size == 1:
        return DistributedEnv(device=device)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None,
                            **({} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}))
    return DistributedEnv(rank, world_size, local_rank, device, backend)


def destroy_distributed() -> None:
    """Leave the process group (a no-op in a one-process run).

    Call it after the DDP / FSDP2 model and the optimizer are released: with gloo we saw a
    DDP model that outlived its process group hang in its destructor at exit.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    """The processes of this run: the process group's size, else those ``torchrun`` launched
    (``WORLD_SIZE``), else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return launched_world_size()


def current_env() -> DistributedEnv:
    """The :class:`DistributedEnv` of an already initialised process group (or one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistributedEnv()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return DistributedEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())


def transformer_blocks(model: nn.Module, block_types: Iterable[type] | None = None) -> list[nn.Module]:
    """The repeated blocks that FSDP2 shards one by one (one all-gather per block).

    ``block_types`` if given; else the classes a Hugging Face model names in
    ``_no_split_modules`` (``LlamaDecoderLayer``); else every child of an ``nn.ModuleList``.
    """
    if block_types is not None:
        types = tuple(block_types)
        return [m for m in model.modules() if isinstance(m, types)]
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if blocks:
            return blocks
    return [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]


def parallelize(
    model: nn.Module,
    mode: str,
    env: DistributedEnv | None = None,
    *,
    block_types: Iterable[type] | None = None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    find_unused_parameters: bool = False,
) -> nn.Module:
    """Apply data parallelism to a built model; returns the model to train.

    * ``"none"``: the model itself.
    * ``"ddp"``: ``DistributedDataParallel`` (gradients all-reduced, averaged). Parameters stay
      plain tensors, so any optimizer works unchanged; ``FiraAdamW(..., split_refresh=True)``
      shares the refresh SVDs across ranks.
    * ``"fsdp2"``: ``fully_shard`` on every transformer block (:func:`transformer_blocks`), then
      on the root. Parameters become DTensors sharded on dim 0 and Fira runs on the shards
      (:mod:`fira_optim.distributed`). ``param_dtype`` / ``reduce_dtype`` set FSDP2's mixed
      precision (e.g. bf16 compute with fp32 gradient reduction).

    Build the optimizer after this call: FSDP2 replaces the parameters.
    """
    if mode not in PARALLEL_MODES:
        raise ValueError(f"Invalid parallel mode: {mode!r}; expected one of {PARALLEL_MODES}")
    if mode == "none":
        return model
    env = env or current_env()
    if not env.distributed:
        raise RuntimeError(
            f"parallelize(model, {mode!r}) needs a process group: launch with torchrun "
            "(torchrun --nproc_per_node N -m fira_train ...) and call init_distributed() first"
        )
    if mode == "ddp":
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids,
                                       find_unused_parameters=find_unused_parameters)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    for block in transformer_blocks(model, block_types):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies the model in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def shard_batch(batch: torch.Tensor, env: DistributedEnv | None = None) -> torch.Tensor:
    """This rank's rows of a global batch: contiguous blocks of ``B / N`` rows.

    Every rank reads the same global batch stream (so the data position in a checkpoint is
    global and a run resumes at any world size); DDP and FSDP2 average the gradients of the
    blocks, which equals the gradient of the mean loss over the global batch.
    """
    env = env or current_env()
    if env.world_size == 1:
        return batch
    if batch.shape[0] % env.world_size != 0:
        raise ValueError(
            f"global batch size {batch.shape[0]} does not divide by the world size "
            f"{env.world_size}: every rank must get the same number of rows"
        )
    return batch.chunk(env.world_size)[env.rank]


def all_reduce_mean(value: torch.Tensor | float, env: DistributedEnv | None = None) -> float:
    """The mean of a per-rank scalar (a loss) over all ranks, as a Python float."""
    env = env or current_env()
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().to(env.device).reshape(())
    if env.distributed:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        tensor /= env.world_size
    return float(tensor)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also returns a plain tensor under FSDP2.

    For DTensor gradients torch computes the global norm over the shards; the result is a
    replicated DTensor, returned here as its local (full) value for logging.
    """
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
