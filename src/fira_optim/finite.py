"""Non-finite gradients: found before anything changes, with one host sync per step."""

from __future__ import annotations

import torch


class NonFiniteGradientError(RuntimeError):
    """A gradient holds NaN or Inf; raised before anything is modified."""


def finite_flags(checks: list[torch.Tensor]) -> torch.Tensor:
    """One bool per tensor, in order: whether its norm is finite, without a host sync.

    A NaN or Inf entry makes a tensor's norm non-finite, so one ``foreach`` norm over all of
    them (a single read of each) clears the common case. The checks are the gradients of the
    unprojected params and the column norms of each R = P^T G (non-finite iff G is). A False
    can also be a norm that overflowed from finite entries: :func:`recheck_overflow`.
    """
    totals = torch._foreach_norm(checks)
    if any(t.dtype != totals[0].dtype for t in totals):
        totals = [t.float() for t in totals]
    return torch.isfinite(torch.stack(totals))


def recheck_overflow(checks: list[torch.Tensor], flags: torch.Tensor) -> torch.Tensor:
    """``flags`` with each False decided entry by entry (whether all entries are finite)."""
    flags = flags.clone()
    for i in (~flags).nonzero().flatten().tolist():
        flags[i] = torch.isfinite(checks[i]).all()
    return flags
