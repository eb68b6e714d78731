"""Inspecting optimizer state: what it holds and how much."""

from __future__ import annotations

import torch


def optimizer_state_numel(optimizer: torch.optim.Optimizer, *, count_steps: bool = False) -> int:
    """Elements held in ``optimizer.state`` (any torch optimizer).

    Step counters are left out unless ``count_steps``: they are bookkeeping scalars, and the
    paper's memory formula (``m r + 2 n r + 1`` for Fira) does not count them.
    """
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and (count_steps or key != "step"):
                total += value.numel()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in ``optimizer.state`` tensors (step counters included)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
