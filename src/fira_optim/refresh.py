r"""Stage 1 of Algorithm 1: which bases are due, and where their decompositions run.

Every ``T`` steps (or each matrix at its own offset under ``stagger``) a matrix takes a new basis
from its gradient, by the group's projector (:func:`fira_optim.projection.compute_basis`); never
from a zero or non-finite gradient, and a failed decomposition keeps the previous basis. This
module decides that rule once (:func:`refresh_outcome`) and runs it in one of three places:

* in turn, as each matrix is planned (one process, one due matrix or one thread);
* side by side in a pool of single-thread workers on the host (:func:`refresh_in_threads`): a
  CPU run, or accelerator gradients with ``host_refresh=True``;
* across the ranks of a process group (:func:`refresh_together`): FSDP2, or DDP with
  ``split_refresh=True`` (:func:`fira_optim.distributed.refresh_bases`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional

import torch

from . import distributed
from .options import Projector, param_name
from .projection import compute_basis, projected_rank, projection_side

if TYPE_CHECKING:
    from .optimizer import Fira

#: ``{param: (status, basis)}`` of the matrices due this step.
Outcomes = dict


def refresh_due(group: dict, step: int, order: int, total: Optional[int]) -> bool:
    """Whether matrix number ``order`` (of ``total``, counted under ``stagger``) takes a new
    basis at ``step``."""
    period = group["update_proj_gap"]
    offset = (order * period) // total if group["stagger"] else 0
    return step == 0 or (step - offset) % period == 0


def refresh_outcome(grad, previous, *, rank, side, group, order, step, name):
    """The refresh rule on a whole gradient: ``(status, basis)``, status one of
    :data:`fira_optim.distributed.REFRESH_STATUSES`. Never a basis from a zero or non-finite
    gradient. On the CPU it runs on one intra-op thread (:func:`_one_thread_on_cpu`)."""
    with _one_thread_on_cpu(grad):
        if not bool(torch.isfinite(grad).all()):
            return "nonfinite", None
        if not bool(grad.any()):
            return "zero", None
        basis = new_basis(grad, rank, side, group, previous, order, step, name)
    return ("new", basis) if basis is not None else ("keep", None)


@contextlib.contextmanager
def _one_thread_on_cpu(grad: torch.Tensor) -> Iterator[None]:
    """A CPU refresh on one intra-op thread, wherever it runs (the calling thread's count is
    given back after it, and with it torch's process-wide default, which a thread takes at its
    first parallel call). LAPACK's SVD of a matrix of a few hundred rows differs with the thread
    count (already at 256 x 256, between one and two threads): a lone refresh on all threads
    and several due together on one each (:func:`refresh_in_threads`) made the bases depend on
    how many matrices refreshed in the step, so an update in the backward pass (each matrix
    alone) was not the plain step's bit for bit, nor a staggered run the same on two machines with
    other core counts. In the pool's workers it also keeps each from opening an OpenMP team of
    every core. The price: a lone refresh of a large matrix on the CPU no longer uses the other
    cores (a GPU's refreshes run as before)."""
    threads = torch.get_num_threads()
    if grad.device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def new_basis(grad, rank, side, group, previous, order, step, name):
    """The group's projector on ``grad``; on failure a warning, then the previous basis
    (None) or, before any basis exists, a random one."""
    generator = torch.Generator().manual_seed(refresh_seed(group["seed"], order, step))
    try:
        return compute_basis(grad, rank, side, group["projector"], previous, generator,
                             align_signs=group["align_signs"])
    except RuntimeError as err:
        fallback = "using a random basis" if previous is None else "keeping the previous basis"
        warnings.warn(f"projection basis failed for {name} ({err}); {fallback}", RuntimeWarning)
        if previous is None:
            return compute_basis(grad, rank, side, Projector.RANDOM, None, generator)
        return None


def refresh_seed(seed: int, order: int, step: int) -> int:
    """The random projector's seed for matrix number ``order`` refreshing at ``step``: a 63-bit
    hash of the three, so two (matrix, step) pairs of a run practically never share one (for
    ``n`` pairs the chance is about ``n**2 / 2**64``). A linear mix of them repeated under
    ``stagger``, where matrices refresh at steps offset from each other (the second matrix at
    step 39600 drew the seventh's basis of step 5)."""
    digest = hashlib.blake2b(f"{seed}:{order}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # below 2**63


def due_refreshes(opt: "Fira", total: Optional[int], only: Optional[set] = None) -> list[tuple]:
    """``(param, job)`` for every matrix whose basis is due this step (of ``only``, if given),
    in the order of the projected matrices; ``job`` is a :class:`fira_optim.distributed.RefreshJob`
    holding this rank's gradient in its own dtype and the refresh rule (:func:`refresh_outcome`)
    to run on it. Nothing is converted here: converted up front, the fp32 copies of every due
    matrix's bf16 gradient would coexist; each projector converts its own input."""
    due = []
    for gi, pi, p, order in opt._entries(only)[0]:
        if order is None or p.grad is None or p.numel() == 0:
            continue
        group = opt.param_groups[gi]
        state = opt.state[p]
        step = int(state["step"]) if state else 0
        if not refresh_due(group, step, order, total):
            continue
        work_dtype = torch.promote_types(p.dtype, torch.float32)
        grad = distributed.to_local(p.grad)
        side = projection_side(p.shape, group["proj_type"])
        rank = projected_rank(p.shape, group)
        compute = functools.partial(
            refresh_outcome, rank=rank, side=side, group=group,
            order=order, step=step, name=param_name(gi, pi, p, group),
        )
        previous = distributed.to_local(state["basis"]) if step > 0 else None
        due.append((p, distributed.RefreshJob(
            grad, p.shape[0], order, previous, side, rank,
            distributed.row_sharding(p), work_dtype, compute,
        )))
    return due


def refresh_together(opt: "Fira", process_group: Any, total: Optional[int],
                     only: Optional[set] = None) -> Outcomes:
    """The refresh outcomes of every matrix due this step, computed across the ranks of
    ``process_group`` by :func:`fira_optim.distributed.refresh_bases`."""
    due = due_refreshes(opt, total, only)
    return _keyed(due, distributed.refresh_bases([job for _, job in due], process_group))


def refresh_in_threads(opt: "Fira", total: Optional[int],
                       only: Optional[set] = None) -> Optional[Outcomes]:
    """One process on the CPU (or on an accelerator with ``host_refresh``): the refresh
    outcomes of every matrix due this step, computed by ``torch.get_num_threads()`` threads
    at once on the host. None (each matrix refreshes in its turn as it is planned) if fewer
    than two are due or the gradients are elsewhere than on the CPU without ``host_refresh``.

    LAPACK's SVD of a small matrix keeps few cores busy, so decompositions of different
    matrices side by side use the others, each on one intra-op thread. Workers left at
    torch's default each open an OpenMP team of every core inside MKL's LAPACK, and the
    teams oversubscribe the cores: on 2 cores a refresh then often stalled for hundreds of
    milliseconds, even where each matrix takes one (``benchmarks/refresh_threads.py``, ``micro``).
    So every CPU refresh runs on one intra-op thread (:func:`_one_thread_on_cpu`, per thread: the
    caller's count stays as it was).

    On the CPU the outcomes are therefore the sequential refresh's calls on the same inputs, bit
    for bit, as LAPACK's SVD depends on the thread count. With ``host_refresh`` the sequential refresh (a lone one)
    runs on the device, whose SVD equals the host's to round-off only. A gradient found
    non-finite is reported in the usual order.
    """
    workers = torch.get_num_threads()
    if only is not None and len(only) < 2:  # one matrix (an update in the backward pass)
        return None
    on_host = all(p.device.type == "cpu" for group in opt.param_groups for p in group["params"])
    if workers < 2 or not (on_host or opt.host_refresh):
        return None  # before due_refreshes, which builds a job for every due matrix
    due = due_refreshes(opt, total, only)
    if len(due) < 2:
        return None
    jobs = [job for _, job in due]
    if not on_host:  # blocking copies: the SVDs must see the finished gradients
        inputs = [(job.grad.cpu(), None if job.previous is None else job.previous.cpu()) for job in jobs]
    else:
        inputs = [(job.grad, job.previous) for job in jobs]
    with ThreadPoolExecutor(min(workers, len(due))) as pool:
        outcomes = list(pool.map(lambda job, args: job.compute(*args), jobs, inputs))
    if not on_host:
        outcomes = [(status, None if basis is None else basis.to(job.grad.device))
                    for (status, basis), job in zip(outcomes, jobs)]
    return _keyed(due, outcomes)


def _keyed(due: list[tuple], outcomes: list[tuple]) -> Outcomes:
    return {p: outcome for (p, _), outcome in zip(due, outcomes)}

