r"""Fira under ``torch.distributed``: DDP (replicated parameters) and FSDP2 (row-sharded DTensors).

Nothing here runs in a single process: :class:`fira_optim.Fira` calls in only when a parameter is a
DTensor or when ``split_refresh=True``.

**DDP.** Parameters are plain tensors and, after DDP's all-reduce, every rank holds the same
gradient, so the one-process optimizer is already correct. ``split_refresh=True`` divides the
refresh work: the matrices due for a new basis are dealt round-robin to the ranks, each rank
computes the bases of its share, and one broadcast per rank hands them out. A refresh costs
about ``1/N`` of the SVD time per rank and every rank holds bitwise the same bases.

**FSDP2.** ``fully_shard`` makes every weight a DTensor sharded on dim 0 in ``torch.chunk`` row
blocks (``ceil(m/N)`` rows per rank, the last blocks shorter or empty when ``N`` does not
divide ``m``). Rank ``k`` holds the rows ``W_k``, ``G_k`` and the optimizer works on them:

.. math::
    \textbf{left } (P \in \mathbb{R}^{m \times r} \text{, rows sharded like } W):\quad
    R = \textstyle\sum_k P_k^\top G_k, \quad
    \|g_i\|^2 = \textstyle\sum_k \|g_{k,i}\|^2, \quad
    W_k \mathrel{-}= \eta\alpha\,(P_k (N - R\,c) + G_k\,c)

    \textbf{right } (Q \in \mathbb{R}^{n \times r} \text{, replicated}):\quad
    R_k = G_k Q, \quad
    \|S\|^2 = \textstyle\sum_k \|S_k\|^2, \quad
    W_k \mathrel{-}= \eta\alpha\,((N_k - R_k c) Q^\top + c\,G_k)

For a left projection ``R`` (``r x n``) is completed by one all-reduce, batched over all
matrices together with the finiteness checks, and Adam runs on it redundantly on every rank
(its states are replicated, ``2 r n`` per rank); the ``n`` column norms of ``G`` take a second,
small all-reduce. For a right projection everything per row is local, the Adam states are
row-sharded for free and only the scalars ``||S||^2`` and ``||phi G||^2`` (the check of the
column-norm subtraction's precision, :func:`fira_optim.residual.cancelled`) are reduced, with one
more all-reduce for each matrix whose ``S`` must then be formed. A matrix-level scaling factor
of a right projection reduces two more scalars. No full gradient moves on ordinary steps.

At a refresh (every ``T`` steps, or the matrices due under ``stagger``) the row blocks of each
due gradient are gathered on one rank (round-robin over the due matrices), that rank runs the
SVD (or the randomized projector, whose warm start gets the previous basis rows the same way)
and broadcasts the basis; each rank keeps its rows of ``P`` or all of ``Q``. Every decision
(zero gradient: no refresh; non-finite gradient; SVD failure) is taken by the owner on the full
gradient and broadcast with the basis, so all ranks take the same branch and issue the same
collectives in the same order.

State of a DTensor parameter is held as DTensors on the parameter's mesh (``Shard(0)`` where
rows follow the parameter: left ``P`` and right ``R``-shaped states; ``Replicate`` otherwise),
with the global shapes of the one-process state, so ``torch.distributed.checkpoint`` saves and
reshards it between world sizes like any other optimizer state.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from .projection import LEFT

if TYPE_CHECKING:  # importing torch.distributed.tensor costs ~2 s: never at run time from here
    from torch.distributed.device_mesh import DeviceMesh

#: Outcome of a projection refresh, decided once (by the rank that computes it) for all ranks:
#: a new basis; keep the previous one (the projector failed); no refresh from a zero gradient;
#: a non-finite gradient; an exception on the computing rank.
REFRESH_STATUSES = ("new", "keep", "zero", "nonfinite", "failed")


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing ``torch.distributed.tensor``.

    A DTensor can only exist once its module is imported, so an unimported module means no.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of a DTensor (a view sharing its storage), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def local_views(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor replaced by its local block; in-place updates of the views
    update the DTensors."""
    return {key: to_local(value) for key, value in state.items()}


@dataclass(frozen=True)
class RowSharding:
    """How a dim-0-sharded DTensor (FSDP2's layout) is spread over the ranks.

    ``mesh_dim`` is the mesh dimension that splits the rows (the only one for plain FSDP2, the
    shard dimension of an HSDP mesh); every other mesh dimension replicates. ``index`` and
    ``size`` are this rank's position and the number of ranks along ``mesh_dim``.
    """

    mesh: "DeviceMesh"
    placements: tuple
    mesh_dim: int
    group: Any  # torch.distributed.ProcessGroup
    index: int
    size: int

    def rows(self, m: int) -> tuple[int, int]:
        """``(start, stop)`` of the rows this rank holds of an ``m``-row tensor (``torch.chunk``)."""
        block = math.ceil(m / self.size) if m else 0
        start = min(self.index * block, m)
        return start, min(start + block, m)

    def sum(self, partial: torch.Tensor) -> torch.Tensor:
        """Complete a sum over the rows of a row-sharded matrix: all-reduce(SUM) over the shards."""
        dist.all_reduce(partial, group=self.group)
        return partial


def block_offset(p: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's block of a DTensor starts in the whole tensor (all zeros for a plain
    tensor and for a replica): what tells one shard's random draws from another's."""
    if not is_dtensor(p):
        return (0,) * p.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1])


def row_sharding(p: torch.Tensor) -> RowSharding | None:
    """The :class:`RowSharding` of a DTensor parameter, ``None`` for a plain tensor.

    Raises ``ValueError`` for any other DTensor layout (tensor-parallel ``Shard(1)``, a DTensor
    replicated on every mesh dimension, strided shards of FSDP2 + TP): Fira's reductions are
    derived for row shards only.
    """
    if not is_dtensor(p):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(p.placements)
    shard_dims = [i for i, pl in enumerate(placements) if type(pl) is Shard and pl.dim == 0]
    others_replicate = all(
        type(pl) is Replicate for i, pl in enumerate(placements) if i not in shard_dims
    )
    if len(shard_dims) != 1 or not others_replicate:
        raise ValueError(
            f"a projected DTensor parameter of shape {tuple(p.shape)} has placements {placements}: "
            "Fira supports DTensors sharded on dim 0 over one mesh dimension and replicated over the "
            "others (FSDP2 fully_shard, HSDP); tensor-parallel or replicated-only layouts are not "
            "supported"
        )
    mesh = p.device_mesh
    mesh_dim = shard_dims[0]
    return RowSharding(
        mesh=mesh,
        placements=placements,
        mesh_dim=mesh_dim,
        group=mesh.get_group(mesh_dim),
        index=mesh.get_local_rank(mesh_dim),
        size=mesh.size(mesh_dim),
    )


FSDP1_MESSAGE = (
    "FSDP1 (FullyShardedDataParallel) flattens weights into 1-D FlatParameter shards, so a "
    "matrix's rows and columns are lost and Fira cannot project it (nor tell which pieces were "
    "2-D weights). Shard with FSDP2 instead, torch.distributed.fsdp.fully_shard, whose DTensor "
    "parameters keep their 2-D shape (fira_train.run.parallel.parallelize(model, 'fsdp2'))"
)


def reject_fsdp1(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` if ``model`` is or contains an FSDP1 module or a FlatParameter.

    With ``use_orig_params=True`` FSDP1 shows the original parameters as 1-D shard views: a
    dim-based choice of what to project would silently project nothing.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None)
    for name, module in model.named_modules():
        if fsdp1 is not None and isinstance(module, fsdp1):
            raise ValueError(f"module {name or '<root>'!r} is wrapped by {FSDP1_MESSAGE}")
    for name, p in model.named_parameters():
        if is_flat_parameter(p):
            raise ValueError(f"parameter {name!r} is a FlatParameter of {FSDP1_MESSAGE}")


def is_flat_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is an FSDP1 ``FlatParameter``."""
    return bool(getattr(p, "_is_flat_param", False))


def shard_group(param_groups: list[dict]) -> Any | None:
    """The process group over which the parameters' rows are sharded (FSDP2), or ``None``.

    Taken from the first row-sharded DTensor; :func:`refresh_bases` checks that every
    projected DTensor shares its size.
    """
    for group in param_groups:
        for p in group["params"]:
            if is_dtensor(p):
                try:
                    return row_sharding(p).group  # type: ignore[union-attr]
                except ValueError:  # e.g. a replicated DTensor in an unprojected group
                    continue
    return None


def nonzero_gradients(params: list[torch.Tensor]) -> list[bool]:
    """Whether each of ``params`` has a gradient with a nonzero entry anywhere: over every shard
    of a sharded DTensor (one all-reduce per sharding mesh dimension for all of them), as in one
    process. ``bool(grad.any())`` on such a DTensor reads this rank's block alone (its ``any`` is
    a partial result), so ranks would decide apart. Called for the plain parameters before their
    first real step only: its host syncs (one per parameter) end there."""
    found = [bool(to_local(p.grad).any()) for p in params]
    # by mesh and the mesh dimensions that shard (rows, or any other dimension: FSDP2's
    # shard_placement_fn, tensor parallelism); a replicated dimension holds the same entries
    by_mesh: dict[tuple, tuple[Any, list[int]]] = {}
    for i, p in enumerate(params):
        if is_dtensor(p.grad):
            mesh = p.grad.device_mesh
            dims = tuple(d for d, placement in enumerate(p.grad.placements) if placement.is_shard())
            if dims:
                by_mesh.setdefault((id(mesh), dims), (mesh, []))[1].append(i)
    for (_, dims), (mesh, indices) in by_mesh.items():
        device = to_local(params[indices[0]].grad).device
        flags = torch.tensor([float(found[i]) for i in indices], device=device)
        for d in dims:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
        for i, flag in zip(indices, flags.tolist()):
            found[i] = flag > 0
    return found


def process_group_or_world(process_group: Any) -> Any | None:
    """``process_group``, the default group when ``None``, or ``None`` outside torch.distributed
    (so ``split_refresh=True`` is harmless in a one-process run)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return process_group if process_group is not None else dist.group.WORLD


def state_zeros(
    param: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, *, row_sharded: bool
) -> torch.Tensor:
    """A zero state tensor of global ``shape`` laid out like ``param``.

    A plain tensor for a plain parameter. For a DTensor parameter: a DTensor on its mesh, with
    the parameter's row sharding when ``row_sharded`` (its rows follow the rows of the weight),
    replicated otherwise.
    """
    sharding = row_sharding(param)
    if sharding is None:
        return torch.zeros(tuple(shape), dtype=dtype, device=param.device)
    from torch.distributed.tensor import DTensor, Replicate

    shape = torch.Size(shape)
    if row_sharded:
        start, stop = sharding.rows(shape[0])
        local = torch.zeros((stop - start, *shape[1:]), dtype=dtype, device=param.device)
        placements = sharding.placements
    else:
        local = torch.zeros(shape, dtype=dtype, device=param.device)
        placements = tuple(Replicate() for _ in sharding.placements)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, sharding.mesh, placements, run_check=False, shape=shape, stride=stride
    )


def reduce_partials(
    partials: list[torch.Tensor], flags: torch.Tensor | None, group: Any
) -> torch.Tensor | None:
    r"""Sum ``partials`` over ``group`` in place and AND ``flags`` across ranks.

    The partials are this rank's :math:`P_k^\top G_k` of every left-projected matrix; one
    all-reduce per dtype carries them all (the first also carries the count of failed
    finiteness checks). Returns the global flags (``None`` if ``flags`` is ``None``).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in partials:
        by_dtype.setdefault(t.dtype, []).append(t)
    if flags is not None and not by_dtype:
        by_dtype[torch.float32] = []
    failed_at = None
    for i, (dtype, tensors) in enumerate(by_dtype.items()):
        pieces = [t.reshape(-1) for t in tensors]
        device = tensors[0].device if tensors else flags.device  # type: ignore[union-attr]
        if i == 0 and flags is not None:
            failed_at = sum(p.numel() for p in pieces)
            pieces.append((~flags).to(dtype=dtype, device=device))
        buffer = torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
        dist.all_reduce(buffer, group=group)
        offset = 0
        for t in tensors:
            t.copy_(buffer[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        if i == 0 and flags is not None:
            flags = buffer[failed_at:].to(flags.device) == 0
    return flags


# ---------------------------------------------------------------------- refresh


@dataclass
class RefreshJob:
    """One matrix due for a new basis, as this rank sees it.

    ``grad``: the gradient this rank holds, in the parameter's dtype (the full matrix under DDP,
    its row block under FSDP2); ``dtype``: the working dtype (fp32 for bf16 parameters), in which
    row blocks are gathered, bases are broadcast and ``compute`` receives a gathered matrix (a
    whole local gradient it receives as it is: the projectors convert their input); ``rows``:
    the global number of rows; ``order``: the matrix's index among the optimizer's projected
    matrices (it picks the rank that computes the basis). ``previous``: this rank's copy of the
    current basis if the projector warm-starts from it (rows of ``P`` under FSDP2 left, all of
    ``Q`` otherwise), else ``None``. ``compute(full_grad, full_previous) -> (status, basis)`` is
    the optimizer's refresh rule; it runs on one rank only and returns a status of
    :data:`REFRESH_STATUSES` and, for ``"new"``, the full basis (``m x r`` or ``n x r``).
    """

    grad: torch.Tensor
    rows: int
    order: int
    previous: torch.Tensor | None
    side: str
    rank: int
    sharding: RowSharding | None
    dtype: torch.dtype
    compute: Callable[[torch.Tensor, torch.Tensor | None], tuple[str, torch.Tensor | None]]

    def __post_init__(self) -> None:
        if self.sharding is not None:
            start, stop = self.sharding.rows(self.rows)
            if self.grad.shape[0] != stop - start:
                raise RuntimeError(
                    f"a row shard holds {self.grad.shape[0]} rows of a {self.rows}-row gradient, "
                    f"expected {stop - start} (the torch.chunk layout of FSDP2)"
                )

    def basis_rows(self) -> int:
        return self.rows if self.side == LEFT else self.grad.shape[1]

    def gathers_previous(self) -> bool:
        # Only a left basis is row-sharded; a right one is replicated and already whole here.
        return self.previous is not None and self.sharding is not None and self.side == LEFT


def refresh_bases(jobs: list[RefreshJob], group: Any) -> list[tuple[str, torch.Tensor | None]]:
    """New bases for ``jobs`` computed across ``group``: ``[(status, this rank's basis), ...]``.

    A job belongs to rank ``order % N`` of the group: a fixed owner per matrix spreads the
    work evenly both when every matrix refreshes at once and under ``stagger``. (1) The row blocks of each sharded
    gradient (and, for a warm-started left projector, of the previous basis) are gathered on
    the owner, one ``gather`` per owner. (2) Every rank computes the bases of the jobs it owns:
    the ranks work in parallel. (3) One ``broadcast`` per owner carries a status code and the
    basis of each of its jobs. A left basis of a sharded parameter is returned as this rank's
    rows; every other basis whole. Every rank must call this with the same job list (it is
    derived from replicated step counts), which keeps the collectives matched.
    """
    if not jobs:
        return []
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    for job in jobs:
        if job.sharding is not None and job.sharding.size != world:
            raise ValueError(
                f"a parameter is sharded over {job.sharding.size} ranks but the refresh runs over "
                f"{world}: every projected DTensor of one optimizer must share one shard group"
            )
    owner_of = [job.order % world for job in jobs]
    dtype = jobs[0].dtype
    for job in jobs[1:]:
        dtype = torch.promote_types(dtype, job.dtype)
    device = jobs[0].grad.device

    # (1) Full gradients (and previous bases) of the jobs this rank owns.
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for owner in range(world):
        sharded = [i for i in range(len(jobs)) if owner_of[i] == owner and jobs[i].sharding is not None]
        if sharded:
            _gather_rows(jobs, sharded, owner, me, world, group, dtype, device, inputs)
    for i, job in enumerate(jobs):
        if owner_of[i] == me and job.sharding is None:
            inputs[i] = (job.grad, job.previous)

    # (2) This rank's share of the SVDs.
    results: dict[int, tuple[str, torch.Tensor | None]] = {}
    error: BaseException | None = None
    for i in sorted(inputs):
        if error is not None:
            results[i] = ("failed", None)
            continue
        try:
            results[i] = jobs[i].compute(*inputs[i])
        except Exception as err:  # tell the other ranks instead of leaving them in a collective
            error = err
            results[i] = ("failed", None)

    # (3) One broadcast per owner: [status code, basis ...] for each of its jobs.
    outcomes: list[tuple[str, torch.Tensor | None]] = [("zero", None)] * len(jobs)
    failed_on: int | None = None
    for owner in range(world):
        owned = [i for i in range(len(jobs)) if owner_of[i] == owner]
        if not owned:
            continue
        sizes = [1 + jobs[i].basis_rows() * jobs[i].rank for i in owned]
        if owner == me:
            parts = []
            for i, size in zip(owned, sizes):
                status, basis = results[i]
                part = torch.zeros(size, dtype=dtype, device=device)
                part[0] = REFRESH_STATUSES.index(status)
                if status == "new":
                    part[1:] = basis.reshape(-1)  # type: ignore[union-attr]
                parts.append(part)
            buffer = torch.cat(parts)
        else:
            buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(buffer, group=group, group_src=owner)
        offset = 0
        for i, size in zip(owned, sizes):
            job = jobs[i]
            status = REFRESH_STATUSES[int(buffer[offset])]
            basis = None
            if status == "new":
                full = buffer[offset + 1 : offset + size].view(job.basis_rows(), job.rank)
                if job.sharding is not None and job.side == LEFT:
                    start, stop = job.sharding.rows(job.rows)
                    full = full[start:stop]
                basis = full.to(job.dtype).clone()
            elif status == "failed" and failed_on is None:
                failed_on = owner
            outcomes[i] = (status, basis)
            offset += size
    if error is not None:
        raise error
    if failed_on is not None:
        raise RuntimeError(f"computing a projection basis failed on rank {failed_on} of the group")
    return outcomes


def _gather_rows(jobs, indices, owner, me, world, group, dtype, device, inputs) -> None:
    """Gather the row blocks of ``jobs[indices]`` on ``owner`` and rebuild the full matrices.

    Each rank pads its block to ``ceil(m/N)`` rows so that the gather has equal sizes; under
    the ``torch.chunk`` layout only trailing ranks are short, so the first ``m`` rows of the
    concatenated padded blocks are the matrix in order.
    """
    shapes = []
    pieces = []
    for i in indices:
        job = jobs[i]
        block = job.sharding.rows(job.rows)
        width = job.grad.shape[1] + (job.rank if job.gathers_previous() else 0)
        rows = math.ceil(job.rows / world)
        shapes.append((rows, width))
        padded = torch.zeros((rows, width), dtype=dtype, device=device)
        n = job.grad.shape[1]
        padded[: block[1] - block[0], :n] = job.grad  # copied once, converted to ``dtype`` on the way
        if job.gathers_previous():
            padded[: block[1] - block[0], n:] = job.previous
        pieces.append(padded.reshape(-1))
    send = torch.cat(pieces)
    receive = [torch.empty_like(send) for _ in range(world)] if me == owner else None
    dist.gather(send, receive, group=group, group_dst=owner)
    if me != owner:
        return
    offset = 0
    for i, (rows, width) in zip(indices, shapes):
        job = jobs[i]
        size = rows * width
        whole = torch.cat([r[offset : offset + size].view(rows, width) for r in receive])[: job.rows]
        whole = whole.to(job.dtype)
        n = job.grad.shape[1]
        previous = whole[:, n:] if job.gathers_previous() else job.previous
        inputs[i] = (whole[:, :n], previous)
        offset += size
