"""Hooks into the training loop (:func:`fira_train.run.train.train`): :class:`TrainCallback`."""

from __future__ import annotations

import torch


class TrainCallback:
    """Hooks into :func:`~fira_train.run.train.train`'s loop; subclasses override what they need
    (both default to no-ops).

    ``step`` is the number of the optimizer step being taken (1 for the first), ``loss`` that
    step's mean training loss. Callbacks are not part of the config or the checkpoint: one that
    changes the trajectory (gradient noise, optimizer options) must be recorded by its caller,
    and is re-applied, not restored, on resume.
    """

    def before_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    loss: float) -> None:
        """After the step's gradients are accumulated in ``p.grad``, before clipping and
        ``optimizer.step()``: gradients may be read or modified here."""

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loss: float) -> None:
        """After ``optimizer.step()``, before the gradients are zeroed: the step's gradients
        and the optimizer state that step produced are both available."""
