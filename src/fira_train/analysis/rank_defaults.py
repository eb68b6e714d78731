"""Default ranks of the rank analyses, as fractions of the recipe's width (d_model).

The paper's rank study runs at d_model 256 with ranks 4, 16, 64 and 128 (the varying-ranks
figure and rank table; ``fira-train analyze rank-sweep``) and its similarity table compares
r/d_model = 16/256 and 128/256 (``fira-train analyze similarity``). A recipe of another width
gets the same ratios r/d_model, rounded to ints in [1, d_model): ``tiny`` (d_model 256) the
paper's ranks, ``micro`` (d_model 64) 1, 4, 16, 32 and 4, 32.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PAPER_D_MODEL", "RANK_SWEEP_FRACTIONS", "SIMILARITY_FRACTIONS", "ranks_for_width"]

#: Width of the paper's rank study.
PAPER_D_MODEL = 256
#: r / d_model of ``analyze rank-sweep``: 4, 16, 64, 128 at d_model 256.
RANK_SWEEP_FRACTIONS = (4 / 256, 16 / 256, 64 / 256, 128 / 256)
#: r / d_model of ``analyze similarity``: 16, 128 at d_model 256.
SIMILARITY_FRACTIONS = (16 / 256, 128 / 256)


def ranks_for_width(d_model: int, fractions: Sequence[float]) -> tuple[int, ...]:
    """``round(f * d_model)`` for each fraction, clamped to [1, d_model - 1], sorted, duplicates dropped."""
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 2:
        raise ValueError(f"d_model must be an int >= 2 to have a rank below it, got {d_model!r}")
    return tuple(sorted({min(max(1, round(f * d_model)), d_model - 1) for f in fractions}))
