"""Hooks into the training loop (:func:`fira_train.run.train.train`): :class:`TrainCallback`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class TrainCallback:
    """Hooks into :func:`~fira_train.run.train.train`'s loop; subclasses override what they need
    (the hooks default to no-ops, the state to none).

    ``step`` is the number of the optimizer step being taken (1 for the first), ``loss`` that
    step's mean training loss. Callbacks are not part of the config: one that changes the
    trajectory (gradient noise, optimizer options) must be recorded by its caller, and is built
    again on resume. What a callback carries from step to step (a random generator, running
    moments) is its :meth:`state_dict`: one-process checkpoints keep it beside the model's, and a
    resumed run loads it into the callbacks built again, in the same order, so that the run
    continues as if it had not stopped.
    """

    def begin(self, step: int) -> None:
        """Once, before the loop's first step: ``step`` is 0 for a new run, the checkpoint's
        step for a resumed one (after :meth:`load_state_dict`). A callback that writes a file
        per step drops here what a stopped sitting wrote after that step."""

    def before_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    loss: float) -> None:
        """After the step's gradients are accumulated in ``p.grad``, before clipping and
        ``optimizer.step()``: gradients may be read or modified here."""

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loss: float) -> None:
        """After ``optimizer.step()``, before the gradients are zeroed: the step's gradients
        and the optimizer state that step produced are both available. Not called for a step
        that ``train.precision=fp16`` skipped (a gradient overflowed: nothing was updated)."""

    def state_dict(self) -> dict[str, Any]:
        """What the callback needs to continue exactly: tensors and plain Python values only
        (``torch.load(weights_only=True)`` reads checkpoints). Empty for a stateless callback."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned. A stateless callback refuses a non-empty
        state: the checkpoint was written with other callbacks."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint holds "
                             f"{sorted(state)} for it: it was written with other callbacks")


def stateful(callbacks: Sequence[TrainCallback]) -> list[str]:
    """The class names of the callbacks that keep state (a non-empty :meth:`~TrainCallback.state_dict`)."""
    return [type(callback).__name__ for callback in callbacks if callback.state_dict()]


def callback_states(callbacks: Sequence[TrainCallback]) -> list[dict[str, Any]]:
    """Each callback's :meth:`~TrainCallback.state_dict`, in order (a checkpoint's ``callbacks``)."""
    return [callback.state_dict() for callback in callbacks]


def load_callback_states(callbacks: Sequence[TrainCallback],
                         states: list[dict[str, Any]] | None) -> None:
    """Load a checkpoint's ``callbacks`` (None: a checkpoint written before callbacks' states
    were kept) into ``callbacks``. ValueError where the two do not match: another number of
    callbacks, or state missing for one that keeps some."""
    if states is None:
        keeping = stateful(callbacks)
        if keeping:
            raise ValueError(f"the checkpoint holds no state of the run's callbacks ({', '.join(keeping)}): "
                             "a distributed run wrote it, or a version that did not keep them, and resuming "
                             "would not continue them exactly; start the run again (--overwrite)")
        return
    if len(states) != len(callbacks):
        if not any(states) and not stateful(callbacks):
            return  # nothing to carry on either side (an analysis's run continued by pretrain --resume)
        raise ValueError(f"the checkpoint holds the state of {len(states)} callbacks, the run has "
                         f"{len(callbacks)}: resume with the callbacks that wrote it")
    for callback, state in zip(callbacks, states):
        callback.load_state_dict(state)
