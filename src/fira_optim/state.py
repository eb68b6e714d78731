"""Inspecting optimizer state: what it holds and how much."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _held_tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors a state value holds: itself, those in a list, tuple or dict, and the tensor
    attributes of a plain object (the released packages keep a projector object per matrix,
    whose basis is a tensor attribute: uncounted, they looked smaller than they are)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _held_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _held_tensors(item)
    elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
        yield from (v for v in vars(value).values() if isinstance(v, torch.Tensor))  # one level only


def optimizer_state_numel(optimizer: torch.optim.Optimizer, *, count_steps: bool = False) -> int:
    """Elements held in ``optimizer.state`` (any torch optimizer), also inside the state's lists,
    dicts and objects (a projector object's basis).

    Step counters are left out unless ``count_steps``: they are bookkeeping scalars, and the
    paper's memory formula (``m r + 2 n r + 1`` for Fira) does not count them.
    """
    return sum(t.numel() for state in optimizer.state.values() for key, value in state.items()
               if count_steps or key != "step" for t in _held_tensors(value))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors :func:`optimizer_state_numel` counts (step counters included)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for value in state.values() for t in _held_tensors(value))
