r"""Stages 1-2 of Algorithm 1, gradient projection: which side to project, how to find the basis, and the two maps.

For a weight gradient :math:`G \in \mathbb{R}^{m \times n}` and rank :math:`r`, a *left*
projection keeps an orthonormal :math:`P \in \mathbb{R}^{m \times r}` and works with
:math:`R = P^\top G \in \mathbb{R}^{r \times n}`; a *right* projection keeps an orthonormal
:math:`Q \in \mathbb{R}^{n \times r}` and works with :math:`R = G Q \in \mathbb{R}^{m \times r}`.
The basis is stored as the tall matrix (``P`` or ``Q``), column-orthonormal, in both cases.

The scaling factors of Fira are taken along the dimension that is *not* projected: one per
column of ``G`` for a left projection (``dim=0`` reductions), one per row for a right
projection (``dim=1`` reductions).
"""

from __future__ import annotations

import math
import warnings

import torch

from .options import PROJ_TYPES, PROJECTORS, Projector, ProjType  # noqa: F401 (the choices, re-exported)

LEFT = "left"
RIGHT = "right"


def projection_side(shape: torch.Size | tuple[int, int], proj_type: str) -> str:
    """Which side a matrix of ``shape`` is projected on.

    ``"std"`` is the released tie rule: right when ``m >= n`` (so square matrices project on
    the right), left otherwise; ``"reverse_std"`` is its mirror image. Projecting on the
    smaller side keeps the Adam states (``r x max(m, n)``) and the basis
    (``min(m, n) x r``) as small as the paper's memory formula says.
    """
    m, n = shape
    # == (not parse): a plain string equals its member, and this runs per matrix and step
    if proj_type == ProjType.STD:
        return RIGHT if m >= n else LEFT
    if proj_type == ProjType.REVERSE_STD:
        return LEFT if m >= n else RIGHT
    return LEFT if ProjType.parse("proj_type", proj_type) is ProjType.LEFT else RIGHT


def reduce_dim(side: str) -> int:
    """The dimension along which per-column (left) or per-row (right) norms are taken."""
    return 0 if side == LEFT else 1


#: Rows summed at a time by :func:`sq_norms` down the columns of a CPU matrix.
BLOCK_ROWS = 128


def sq_norms(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Squared norms of the columns (``dim=0``, shape ``1 x n``) or rows (``dim=1``, ``m x 1``)
    of a matrix: ``torch.linalg.vector_norm(t, dim=dim, keepdim=True) ** 2``.

    Down the columns of a row-major matrix, torch's CPU reduction is strided and several times
    slower than squaring and summing whole rows, so there the rows are squared and summed in
    blocks of :data:`BLOCK_ROWS`: temporaries of at most 128 x n, never the whole matrix.
    Elsewhere (rows, or a GPU) the reduction is used as is.
    """
    if dim != 0 or t.device.type != "cpu":
        return torch.linalg.vector_norm(t, dim=dim, keepdim=True).square_()
    total = t[:BLOCK_ROWS].square().sum(dim=0, keepdim=True)
    for start in range(BLOCK_ROWS, t.shape[0], BLOCK_ROWS):
        total.add_(t[start : start + BLOCK_ROWS].square().sum(dim=0, keepdim=True))
    return total


def norms(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The column (``dim=0``) or row (``dim=1``) norms of a matrix, keepdim: :func:`sq_norms`'s
    square roots."""
    return sq_norms(t, dim).sqrt_()


def basis_shape(shape: tuple[int, int], rank: int, side: str) -> tuple[int, int]:
    m, n = shape
    return (m, rank) if side == LEFT else (n, rank)


def low_rank_shape(shape: tuple[int, int], rank: int, side: str) -> tuple[int, int]:
    m, n = shape
    return (rank, n) if side == LEFT else (m, rank)


def project(grad: torch.Tensor, basis: torch.Tensor, side: str) -> torch.Tensor:
    """:math:`R = P^\\top G` (left) or :math:`R = G Q` (right)."""
    return basis.T @ grad if side == LEFT else grad @ basis


def project_back(low: torch.Tensor, basis: torch.Tensor, side: str) -> torch.Tensor:
    """:math:`P R` (left) or :math:`R Q^\\top` (right)."""
    return basis @ low if side == LEFT else low @ basis.T


def _as_left_problem(grad: torch.Tensor, side: str) -> torch.Tensor:
    # A right basis of G is a left basis of G^T: every projector solves the left problem.
    return grad if side == LEFT else grad.T


#: A tall matrix at least this many times taller than wide has its small-side singular vectors
#: computed from its QR factor R (:func:`svd_basis` with ``fast_route``).
QR_FIRST_RATIO = 1.5


def svd_basis(grad: torch.Tensor, rank: int, side: str, *, fast_route: bool = False,
              qr_first_ratio: float = QR_FIRST_RATIO) -> torch.Tensor:
    r"""Exact top-``rank`` singular vectors of ``grad`` (the paper's projector).

    Runs in at least fp32 (CPU has no bf16/fp16 SVD). If the decomposition fails to
    converge it is retried in float64; a second failure propagates to the caller, which
    keeps the previous basis.

    ``fast_route``: the same exact SVD, by a cheaper route. Work on the tall orientation
    :math:`A` (``grad`` or its transpose: the left and right singular vectors swap), which the
    CPU's LAPACK handles better than a wide matrix. And when the basis wanted is :math:`A`'s
    small side (its right singular vectors: the usual case, a projection on the smaller
    dimension) and :math:`A` is at least :data:`QR_FIRST_RATIO` times taller than wide, take
    :math:`A = QR` first (Householder, ``geqrf``, Q never formed): :math:`A^\top A = R^\top R`,
    so :math:`A`'s right singular vectors are those of the small square :math:`R`, and the SVD
    never computes the ``m x n`` left factor it would then throw away. The round-off and the
    signs it picks differ from ``torch.linalg.svd(grad)``'s, so only callers that align
    signs (``align_signs=True``) use it, and the parity paths keep the plain call.
    """
    work = grad.to(torch.promote_types(grad.dtype, torch.float32))
    try:
        return _svd_basis(work, rank, side, fast_route, qr_first_ratio)
    except RuntimeError as err:  # torch raises torch.linalg.LinAlgError (a RuntimeError)
        warnings.warn(f"SVD failed ({err}); retrying in float64", RuntimeWarning, stacklevel=3)
        return _svd_basis(work.double(), rank, side, fast_route, qr_first_ratio).to(work.dtype)


def _svd_basis(work: torch.Tensor, rank: int, side: str, fast_route: bool,
               qr_first_ratio: float) -> torch.Tensor:
    if not fast_route:
        u, _, vh = torch.linalg.svd(work, full_matrices=False)
        return (u[:, :rank] if side == LEFT else vh[:rank].T).contiguous()
    transposed = work.shape[0] < work.shape[1]
    # A wide row-major grad's .T is column-major: the layout LAPACK reads without a copy.
    tall = work.T if transposed else work
    # LEFT wants grad's left vectors: tall's right ones if transposed; RIGHT the other way round.
    small_side = (side == LEFT) == transposed
    if small_side and tall.shape[0] >= qr_first_ratio * tall.shape[1]:
        packed, _ = torch.geqrf(tall)
        _, _, vh = torch.linalg.svd(packed[: tall.shape[1]].triu(), full_matrices=False)
        return vh[:rank].T.contiguous()
    u, _, vh = torch.linalg.svd(tall, full_matrices=False)
    return (vh[:rank].T if small_side else u[:, :rank]).contiguous()


def randomized_basis(
    grad: torch.Tensor,
    rank: int,
    side: str,
    previous: torch.Tensor | None = None,
    *,
    oversample: int | None = None,
    power_iters: int = 1,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""Approximate top-``rank`` basis by block subspace iteration.

    Warm start (``previous`` given, every refresh after the first): the gradient subspace moves
    slowly between refreshes, so ``power_iters`` rounds of
    :math:`Q \leftarrow \mathrm{qr}(G (G^\top Q))` from the previous basis suffice. Each round
    costs two ``m x n x r`` GEMMs and one ``m x r`` QR instead of a full SVD, and the columns stay
    aligned with the previous ones (signs fixed so that :math:`\mathrm{diag}(R) \ge 0`), which keeps
    the carried-over Adam moments meaningful.

    Cold start: a Gaussian sketch with ``oversample`` extra columns, ``power_iters + 1`` rounds,
    then Rayleigh-Ritz (the top ``rank`` left singular vectors of the small :math:`Q^\top G`).
    """
    a = _as_left_problem(grad, side)
    a = a.to(torch.promote_types(a.dtype, torch.float32))
    m, n = a.shape
    if previous is not None:
        q = previous.to(a.dtype)
        for _ in range(power_iters):
            q = _orthonormal(a @ (a.T @ q))
        return q.contiguous()
    if oversample is None:
        oversample = max(8, rank // 8)
    k = min(rank + oversample, m, n)
    sketch = torch.randn(n, k, generator=generator, dtype=a.dtype, device="cpu").to(a.device)
    q = _orthonormal(a @ sketch)
    for _ in range(power_iters + 1):
        q = _orthonormal(a @ (a.T @ q))
    u_small, _, _ = torch.linalg.svd(q.T @ a, full_matrices=False)  # (k, n) -> (k, k)
    return (q @ u_small[:, :rank]).contiguous()


def _orthonormal(y: torch.Tensor) -> torch.Tensor:
    """Q of the QR decomposition with the sign convention diag(R) >= 0 (column i of Q points
    the same way as column i of ``y``)."""
    q, r = torch.linalg.qr(y)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return q * signs


def random_basis(
    grad: torch.Tensor, rank: int, side: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    """An orthonormalised Gaussian basis: the paper's "w.o.-svd" ablation."""
    m = grad.shape[0] if side == LEFT else grad.shape[1]
    dtype = torch.promote_types(grad.dtype, torch.float32)
    gauss = torch.randn(m, rank, generator=generator, dtype=dtype, device="cpu")
    q, _ = torch.linalg.qr(gauss)
    return q.to(grad.device).contiguous()


def _align(basis: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    r"""``basis`` with column ``i`` negated where it points away from column ``i`` of
    ``previous``, so that :math:`\mathrm{diag}(P_{old}^\top P_{new}) \ge 0`.

    The span, hence Algorithm 1's update, is unchanged; what changes is that the Adam moments
    carried over the refresh keep meaning the same directions, and that the choice no longer
    depends on which SVD routine (CPU, CUDA, precision) produced the vectors.
    """
    dots = (previous.to(basis.dtype) * basis).sum(dim=0)
    signs = torch.where(dots < 0, -1.0, 1.0).to(basis.dtype)
    return basis * signs


def compute_basis(
    grad: torch.Tensor,
    rank: int,
    side: str,
    projector: str,
    previous: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    align_signs: bool = False,
) -> torch.Tensor:
    """Dispatch to the named projector. ``align_signs``: see :func:`_align` (exact SVD
    only: the warm-started randomized projector keeps its columns aligned by construction and
    a random basis has nothing to align with)."""
    projector = Projector.parse("projector", projector)
    if projector is Projector.SVD:
        basis = svd_basis(grad, rank, side, fast_route=align_signs)
        if align_signs and previous is not None:
            basis = _align(basis, previous)
        return basis
    if projector is Projector.RANDOMIZED:
        return randomized_basis(grad, rank, side, previous, generator=generator)
    return random_basis(grad, rank, side, generator)


def captured_energy(grad: torch.Tensor, basis: torch.Tensor, side: str) -> float:
    r"""Fraction of the best rank-r energy that ``basis`` captures.

    :math:`\|P^\top G\|_F^2 / \|U_r^\top G\|_F^2 = \|P^\top G\|_F^2 / \sum_{i \le r} \sigma_i^2`.
    """
    g = grad.to(torch.promote_types(grad.dtype, torch.float32))
    rank = basis.shape[1]
    sigma = torch.linalg.svdvals(g)
    best = float((sigma[:rank] ** 2).sum())
    got = float(project(g, basis.to(g.dtype), side).square().sum())
    return got / best if best > 0 else math.nan


def is_projected(p: torch.Tensor, group: dict) -> bool:
    r"""Whether ``p`` is trained in a subspace: a 2-D tensor of a group with a ``rank`` below
    its smaller side (at ``rank >= min(m, n)`` there is no residual: plain base optimizer).

    Fira-only-scaling (``only_scaling``) projects at any rank: its update
    :math:`\phi(R) \odot G` takes the scaling factors of the low-rank optimizer, which at
    ``rank >= min(m, n)`` runs on all ``min(m, n)`` directions (:func:`projected_rank`); that is
    not Adam (the paper's rank ablation has this full-rank column, beside Adam's)."""
    rank = group["rank"]
    return rank is not None and p.dim() == 2 and (rank < min(p.shape) or bool(group.get("only_scaling")))


def projected_rank(shape: tuple[int, ...] | torch.Size, group: dict) -> int:
    """The number of directions a projected matrix of ``shape`` keeps: ``rank``, at most
    ``min(m, n)`` (reached by Fira-only-scaling only, see :func:`is_projected`)."""
    return min(group["rank"], *shape)
