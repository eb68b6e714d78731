r"""Algorithm 1 as stages over a batch of matrices, and the strategies that run them.

A step of :class:`fira_optim.Fira` is, for every projected matrix:

1. **refresh** the basis every ``T`` steps (:mod:`fira_optim.refresh`, :func:`fira_optim.projection.compute_basis`);
2. **project**, :math:`R = P^\top G` (:func:`fira_optim.projection.project`);
3. **low-rank direction**, :math:`N = \psi(R)` (:func:`fira_optim.subspace.low_rank_directions`);
4. **scaling factor**, :math:`\phi_i = \|N_{:,i}\| / (\|R_{:,i}\| + \epsilon)` (:func:`fira_optim.scaling.scaling_factors`);
5. **residual norm**, :math:`\|\phi \odot (G - P R)\|` (:mod:`fira_optim.residual`);
6. **limiter**, :math:`f = \gamma / \max(\|S_t\| / (\|S_{t-1}\| + \epsilon), \gamma)` (:func:`fira_optim.limiter.limit`);
7. **commit**, :math:`W \leftarrow W - \eta\alpha(P N + f S)` (:mod:`fira_optim.commit`).

Stages 1-2 run per matrix as the optimizer plans its step (:class:`MatrixStep` holds what they
produce); :func:`run_stages` runs 3-7 on a batch of matrices that share hyper-parameters and
step count. A :class:`Strategy` says how, never what: which kernel runs Adam, how column norms
are taken, whether ``S`` and the update are formed as ``m x n`` tensors, and (FSDP2) how a sum
over rows is completed across shards. The reference strategy is the same stages on one matrix
at a time with every term explicit; the fast strategy batches them with ``foreach`` kernels and
never forms an ``m x n`` temporary; the compiled strategy (:mod:`fira_optim.compiled`) fuses
stages 3-6 into one kernel per matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .commit import commit_explicit, commit_fused
from .limiter import limit
from .options import Hyper, Residual
from .projection import RIGHT, norms, reduce_dim, sq_norms
from .residual import cancelled, explicit_residuals, residual_norms_from_columns
from .scaling import ColumnNorms, RowSum, exact_norms, scaling_factors
from .subspace import low_rank_directions


@dataclass(eq=False, slots=True)
class MatrixStep:
    """One projected matrix in one step: what stages 1-2 produced and 3-7 read.

    Under FSDP2 (``sharding`` set) ``local``, ``grad`` and ``state`` are this rank's blocks and
    views (updating them updates the DTensors); otherwise ``local`` is ``param``.
    """

    param: torch.Tensor  #: the parameter as the optimizer holds it
    local: torch.Tensor  #: what the commit updates in place
    #: G in the working dtype (at least fp32); None between stages 2 and 3 when ``source`` is set
    grad: Optional[torch.Tensor]
    side: str  #: "left" (R = P^T G) or "right" (R = G Q)
    basis: torch.Tensor  #: this step's P (or Q)
    new_basis: Optional[torch.Tensor]  #: the refreshed basis to store, if refreshed this step
    low: torch.Tensor  #: R; under FSDP2 left, this rank's share P_k^T G_k until completed
    low_norm: torch.Tensor  #: column (left) or row (right) norms of R, keepdim
    strategy: "Strategy"
    work_dtype: torch.dtype
    sharding: Any = None  #: fira_optim.distributed.RowSharding under FSDP2
    grad_sq: Optional[torch.Tensor] = None  #: ||g_i||^2 along the same dim, for the fast residual norm
    state: Optional[dict] = None  #: the matrix's state tensors (local views, fp32), set on commit
    order: int = 0  #: index among the optimizer's projected matrices
    rounding: Optional[torch.Generator] = None  #: stochastic rounding of a bf16 param
    #: a low-precision (bf16) G itself: its fp32 copy ``grad`` exists only while this matrix is
    #: projected and while it is updated, so that no two matrices' copies coexist
    source: Optional[torch.Tensor] = None

    @property
    def dim(self) -> int:
        return reduce_dim(self.side)


@dataclass(frozen=True)
class MatrixStats:
    """What a step measured of one matrix (:meth:`fira_optim.Fira.register_step_stats_hook`).

    Tensors, so reading them is the caller's host sync, never the optimizer's."""

    param: torch.Tensor
    strategy: str
    residual_norm: Optional[torch.Tensor]  #: ||S_t|| before the limiter (None: GaLore)
    limiter_factor: Optional[torch.Tensor]  #: f; 1 where the limiter did not bind (None: GaLore)


@dataclass(frozen=True)
class Strategy:
    """How the stages run (kernels and data layout), for matrices that it :meth:`supports`."""

    name: str
    explicit: bool  #: form S and the update as m x n tensors (the reference)
    fused_adam: bool  #: Adam through torch's fused kernel where it applies
    column_norms: ColumnNorms  #: how column norms of R and N are taken

    def supports(self, hp: Hyper, param: torch.Tensor, grad: torch.Tensor) -> bool:
        return True

    def run(self, batch: list[MatrixStep], step: int, hp: Hyper, row_sum: RowSum = None,
            stats: Optional[list] = None) -> None:
        run_stages(batch, step, hp, self, row_sum, stats)


class FastStrategy(Strategy):
    def supports(self, hp: Hyper, param: torch.Tensor, grad: torch.Tensor) -> bool:
        # FRUGAL's sign residual has no form without S. (A low-precision param is no reason:
        # the optimizer hands every strategy a working-dtype copy of it and rounds once after.)
        return hp.residual is not Residual.SIGN


REFERENCE = Strategy("reference", explicit=True, fused_adam=False, column_norms=exact_norms)
FAST = FastStrategy("fast", explicit=False, fused_adam=True, column_norms=norms)


def run_stages(batch: list[MatrixStep], step: int, hp: Hyper, strategy: Strategy,
               row_sum: RowSum = None, stats: Optional[list] = None) -> None:
    """Stages 3-7 for ``batch`` (matrices of one group and step count), in place.

    ``step`` is the step count after the increment (1 on the first update); ``row_sum``
    completes a sum over rows across FSDP2 shards (None in one process); ``stats``, if a list,
    receives a :class:`MatrixStats` per matrix.
    """
    lows = [m.low for m in batch]
    sides = [m.side for m in batch]
    directions = low_rank_directions(lows, [m.state for m in batch], step, hp,
                                     fused=strategy.fused_adam)
    if hp.residual is Residual.DROP:  # GaLore: W -= lr alpha P N
        factors = norms = None
    else:
        low_norms = [m.low_norm for m in batch]
        phis = None
        if hp.residual is not Residual.SIGN:
            phis = scaling_factors(directions, lows, low_norms, [m.dim for m in batch], hp.scaling,
                                   hp.residual_eps, column_norms=strategy.column_norms,
                                   from_column_norms=not strategy.explicit, row_sum=row_sum,
                                   right=[side == RIGHT for side in sides])
        if strategy.explicit:
            norms, scaled = explicit_residuals([m.grad for m in batch], lows,
                                               [m.basis for m in batch], sides, phis, hp, row_sum)
        else:
            grad_sqs = [m.grad_sq if m.grad_sq is not None else sq_norms(m.grad, m.dim)
                        for m in batch]
            norms, wholes = residual_norms_from_columns(grad_sqs, low_norms, phis, sides, hp, row_sum)
            norms = exact_where_cancelled(norms, wholes, batch, phis, hp, row_sum)
        factors = limit(norms, [m.state["prev_norm"] for m in batch], hp)
    if strategy.explicit:
        for i, m in enumerate(batch):
            commit_explicit(m.local, m.basis, m.side, directions[i],
                            None if factors is None else scaled[i],
                            None if factors is None else factors[i], step, hp)
    else:
        commit_fused([m.local for m in batch], [m.grad for m in batch], [m.basis for m in batch],
                     sides, directions, lows, None if factors is None else phis, factors, step, hp)
    if stats is not None:
        for i, m in enumerate(batch):
            stats.append(MatrixStats(m.param, strategy.name, None if norms is None else norms[i],
                                     None if factors is None else factors[i]))


def exact_where_cancelled(norms: torch.Tensor, wholes: torch.Tensor, batch: list[MatrixStep], phis,
                          hp: Hyper, row_sum: RowSum = None) -> torch.Tensor:
    """``norms`` with each one that the column-norm subtraction left imprecise
    (:func:`fira_optim.residual.cancelled`) replaced by the norm of ``S`` formed explicitly, one
    matrix at a time (an ``m x n`` temporary each, only for those matrices)."""
    redo = cancelled(norms, wholes)
    if not redo:
        return norms
    norms = norms.clone()
    for i in redo:
        m = batch[i]
        exact, _ = explicit_residuals([m.grad], [m.low], [m.basis], [m.side], [phis[i]], hp, row_sum)
        norms[i] = exact[0]
    return norms
