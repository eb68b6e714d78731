r"""When a pre-training run has diverged.

The rule: a run has diverged when a loss it measures -- the mean training loss of an optimizer
step, or a validation loss -- is not finite or exceeds :data:`DIVERGENCE_LOSS` = 100 nats per
token. A model that guesses uniformly over a 32,000-token vocabulary scores
:math:`\ln 32000 \approx 10.4` and every recipe starts near :math:`\ln V`; a mean loss of 100
(a perplexity of :math:`e^{100} \approx 2.7 \cdot 10^{43}`) is ten times worse than knowing
nothing, which only weights that have blown up (typically a learning rate far too large) give.
Validation perplexity overflows to ``inf`` from a loss of about 709.

A diverged run stops with :class:`DivergedError` (``fira-train`` exits with status 1 and says
so): for a training loss before that step's update is applied, for a validation loss after the
step is logged and before it is checkpointed. Checkpoints already written stay; no
``summary.json`` is written, so a comparison or analysis never reuses the run as finished.
"""

from __future__ import annotations

import math

__all__ = ["DIVERGENCE_LOSS", "DivergedError", "diverged", "check_loss"]

#: Mean token loss (nats) above which a run counts as diverged.
DIVERGENCE_LOSS = 100.0


class DivergedError(FloatingPointError):
    """A loss above :data:`DIVERGENCE_LOSS` (or not finite): the run diverged and stopped."""

    def __init__(self, step: int, loss: float, what: str = "training loss") -> None:
        value = f"{loss:.4g}" if math.isfinite(loss) else str(loss)
        super().__init__(
            f"the run diverged at step {step}: {what} {value} (a run diverges when a loss is not finite "
            f"or above {DIVERGENCE_LOSS:g}); lower optim.lr or set train.grad_clip (e.g. 1.0) and train "
            "the run again (a resume keeps the run's settings: it would train the same steps again)")
        self.step, self.loss, self.what = step, loss, what

    def __reduce__(self) -> tuple:  # crosses process boundaries (analysis workers)
        return (type(self), (self.step, self.loss, self.what))


def diverged(loss: float) -> bool:
    """Whether a mean token loss means the run diverged (:data:`DIVERGENCE_LOSS`)."""
    return not math.isfinite(loss) or loss > DIVERGENCE_LOSS


def check_loss(step: int, loss: float, what: str = "training loss") -> None:
    """Raise :class:`DivergedError` if ``loss`` (of step ``step``) means the run diverged."""
    if diverged(loss):
        raise DivergedError(step, loss, what)
