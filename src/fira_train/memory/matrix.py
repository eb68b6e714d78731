r"""Memory footprint of one weight matrix under Fira, GaLore, LoRA, full-rank Adam and the paper's
other baselines (APOLLO, APOLLO-Mini, Flora, SlimAdam).

Pure functions of matrix shapes (no tensors are allocated). For a weight
:math:`W \in \mathbb{R}^{m \times n}` written with :math:`m \le n` (the projection basis
lives on the smaller side, as the ``"std"`` projection rule chooses) and rank :math:`r`,
the paper's Table "Comparison of different methods" counts, in elements:

=================  ===================  ===================  ===================  ========
                   Fira                 GaLore               LoRA                 Adam
=================  ===================  ===================  ===================  ========
weights            :math:`mn`           :math:`mn`           :math:`mn + mr + nr` :math:`mn`
optimizer states   :math:`mr + 2nr + 1` :math:`mr + 2nr`     :math:`2mr + 2nr`    :math:`2mn`
gradients          :math:`mn`           :math:`mn`           :math:`mr + nr`      :math:`mn`
=================  ===================  ===================  ===================  ========

Fira's and GaLore's states are the basis :math:`P \in \mathbb{R}^{m \times r}` plus Adam's two
moments of :math:`R = P^\top G \in \mathbb{R}^{r \times n}`; Fira adds one scalar, the norm
:math:`\|S_{t-1}\|` kept by the norm-growth limiter. LoRA trains :math:`B \in \mathbb{R}^{m
\times r}` and :math:`A \in \mathbb{R}^{r \times n}` with Adam and freezes :math:`W_0`.

A projected matrix with :math:`r \ge \min(m, n)` gains nothing from a basis: it is trained
with plain Adam and costs :math:`2mn` (the optimizer does exactly that, so the formula
follows it). ``"full"`` is an alias of ``"adam"``.

The other baselines (:data:`PEER_METHODS`; weights and gradients :math:`mn` for all four, so
only their optimizer states differ; :math:`a = \min(m, n)`, :math:`b = \max(m, n)`):

* ``apollo`` / ``apollo-mini`` (rank 1): :math:`2br + 2` -- Adam's two moments of the projected
  gradient (``r x b``), the norm kept by Fira's limiter, and the seed of the random projection
  (an integer, counted as one element): a random basis need not be stored, it can be redrawn
  from the seed. (apollo-torch 1.0.3 does cache the current ``r x a`` random matrix in its
  projector object between refreshes, :math:`ar` more elements, as much as GaLore's basis; the
  estimate counts what the method needs, the seed.) APOLLO projects at any rank, so there is
  no fall-back to Adam when :math:`r \ge a`;
* ``flora``: :math:`br + m + n + 2` -- the momentum compressed to ``r x b``, Adafactor's
  factored second moment (a row and a column vector), its RMS scalar and the projection seed.
  The momentum stays full (:math:`mn + m + n + 1`) where flora-opt does not compress it:
  :math:`r > a` or :math:`b / a > 4` (its "rule out embeddings");
* ``slimadam``: :math:`mn + n` -- the full first moment and the second moment averaged over the
  fan-out (dimension 0), a vector of the fan-in :math:`n`; ``compressed_dim=1`` (query, key,
  the embedding and the head in SlimAdam's rules) keeps :math:`m` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

PEER_METHODS = ("apollo", "apollo-mini", "flora", "slimadam")
METHODS = ("fira", "galore", "lora", "adam", "full", *PEER_METHODS)
PROJECTED_METHODS = ("fira", "galore")


class MatrixFootprint(NamedTuple):
    """Elements one ``m x n`` weight matrix costs (the three rows of the paper's table)."""

    weights: int
    gradients: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states


def _check_shape(shape: Sequence[int]) -> tuple[int, int]:
    if isinstance(shape, (str, bytes)) or len(shape) != 2:
        raise ValueError(f"shape must be a pair (m, n) of a 2-D weight, got shape={shape!r}")
    m, n = shape
    for dim in (m, n):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"shape must hold positive ints, got shape={tuple(shape)!r}")
    return m, n


def _check_rank(rank: int | None, method: str) -> int:
    if method in ("adam", "full", "slimadam"):
        return 0  # unused; any value (including None) is accepted
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int for method={method!r}, got rank={rank!r}")
    return rank


def _check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got method={method!r}")
    return method


def is_projected(shape: Sequence[int], rank: int) -> bool:
    """Whether a rank-``rank`` projection of an ``m x n`` matrix is smaller than the matrix
    (``rank < min(m, n)``); otherwise Fira and GaLore fall back to full Adam on it."""
    m, n = _check_shape(shape)
    return rank < min(m, n)


def state_numel(shape: Sequence[int], rank: int | None, method: str, *, compressed_dim: int = 0) -> int:
    r"""Optimizer-state elements for one ``m x n`` weight matrix.

    With :math:`a = \min(m, n)`, :math:`b = \max(m, n)`:
    ``fira`` :math:`ar + 2br + 1`, ``galore`` :math:`ar + 2br` (both :math:`2mn` when
    :math:`r \ge a`), ``lora`` :math:`2(m + n)r`, ``adam``/``full`` :math:`2mn`, and the
    other baselines' counts of the module docstring.

    Args:
        shape: ``(m, n)``, e.g. an ``nn.Linear`` weight's ``(out_features, in_features)``.
        rank: the projection (or adapter) rank; ignored for ``adam``/``full``/``slimadam``.
        method: one of :data:`METHODS`.
        compressed_dim: ``slimadam`` only: the dimension its second moment is averaged over.
    """
    return footprint_numel(shape, rank, method, compressed_dim=compressed_dim).optimizer_states


def footprint_numel(shape: Sequence[int], rank: int | None, method: str, *,
                    compressed_dim: int = 0) -> MatrixFootprint:
    """Weights, gradients and optimizer states (elements) of one ``m x n`` matrix, per the
    paper's Table "Comparison of different methods" (see the module docstring)."""
    method = _check_method(method)
    m, n = _check_shape(shape)
    r = _check_rank(rank, method)
    full = m * n
    if method in ("adam", "full"):
        return MatrixFootprint(full, full, 2 * full)
    if method == "lora":
        adapters = (m + n) * r
        return MatrixFootprint(full + adapters, adapters, 2 * adapters)
    small, large = min(m, n), max(m, n)
    if method in ("apollo", "apollo-mini"):
        return MatrixFootprint(full, full, 2 * large * r + 2)  # moments, limiter norm, seed
    if method == "flora":
        if r <= small and large <= 4 * small:
            return MatrixFootprint(full, full, large * r + m + n + 2)  # momentum, factors, RMS, seed
        return MatrixFootprint(full, full, full + m + n + 1)
    if method == "slimadam":
        if compressed_dim not in (0, 1):
            raise ValueError(f"compressed_dim must be 0 or 1, got compressed_dim={compressed_dim!r}")
        return MatrixFootprint(full, full, full + (n if compressed_dim == 0 else m))
    if r >= small:
        return MatrixFootprint(full, full, 2 * full)
    states = small * r + 2 * large * r
    if method == "fira":
        states += 1  # the limiter's previous norm ||S_{t-1}||
    return MatrixFootprint(full, full, states)


def llama_matrix_shapes(hidden: int, intermediate: int, layers: int) -> list[tuple[int, int]]:
    """Shapes ``(out, in)`` of the ``nn.Linear`` weights of a LLaMA decoder stack.

    Per layer, in module order: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``
    (``hidden x hidden``, multi-head attention without grouped KV), ``gate_proj``, ``up_proj``
    (``intermediate x hidden``) and ``down_proj`` (``hidden x intermediate``). Embeddings,
    the output head and RMSNorm weights are not included: Fira never projects them.
    """
    for name, value in (("hidden", hidden), ("intermediate", intermediate), ("layers", layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    attention = [(hidden, hidden)] * 4
    mlp = [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    return (attention + mlp) * layers


def vector_state_numel(size: int, method: str) -> int:
    """Optimizer-state elements of a 1-D parameter (an RMSNorm gain) of ``size`` elements.

    ``2 size`` (Adam's two moments) for every method, ``2 size + 1`` for ``flora`` (a full
    momentum and second moment and Adafactor's RMS scalar). SlimAdam does not compress norms.
    """
    method = _check_method(method)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got size={size!r}")
    return 2 * size + (1 if method == "flora" else 0)


def total_state_numel(shapes: Sequence[Sequence[int]], rank: int | None, method: str) -> int:
    """Sum of :func:`state_numel` over ``shapes``."""
    return sum(state_numel(shape, rank, method) for shape in shapes)


__all__ = [
    "METHODS",
    "PEER_METHODS",
    "PROJECTED_METHODS",
    "MatrixFootprint",
    "footprint_numel",
    "is_projected",
    "llama_matrix_shapes",
    "state_numel",
    "total_state_numel",
    "vector_state_numel",
]
