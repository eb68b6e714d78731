r"""Training-loop callbacks of the analyses (:class:`fira_train.run.callbacks.TrainCallback`).

- :class:`GradientNoise`: :math:`G \leftarrow G + s\,\xi,\ \xi \sim \mathcal{N}(0, I)` for every
  trainable parameter before the optimizer step (the paper's noise-robustness table).
- :class:`GroupOptions`: sets optimizer options (e.g. the limiter's :math:`\gamma`) on every
  projected param group before each step.
- :class:`NormRecorder`: per step, the global norm of the raw gradient and, for the Fira
  family, the global norm of the scaled, limited residual :math:`\|S_t\|` that the optimizer
  applied (the limiter figure).

The builders at the end (:func:`record_norms`, :func:`record_norms_with_noise`,
:func:`set_options`) are what an :class:`~fira_train.analysis.runs.AnalysisRun` names as its
``callbacks``: module-level functions (bound with :func:`functools.partial`), so that a run can
be sent to a worker process (``--jobs``).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import torch

from fira_train.analysis.runs import JsonlWriter
from fira_train.run.callbacks import TrainCallback


def noise_seed(seed: int) -> int:
    """The seed of :class:`GradientNoise`'s generator for a run seeded ``seed``: 63 bits of a hash
    of it, apart from the streams ``torch.manual_seed(seed)`` gives the rest of the run."""
    digest = hashlib.blake2b(f"{seed},gradient-noise".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63)


class GradientNoise(TrainCallback):
    r"""Add :math:`s\,\mathcal{N}(0, 1)` noise to every gradient entry before the optimizer step.

    The noise comes from a generator of its own, so the data order and every other random draw
    of the run are those of the noise-free run. Its seed is derived from ``seed``
    (:func:`noise_seed`), not ``seed`` itself: the model is initialised from ``seed``'s stream, so
    the first steps' noise repeated the initial weights (divided by their init scale) on other
    tensors.
    """

    def __init__(self, scale: float, seed: int = 0) -> None:
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale >= 0):
            raise ValueError(f"noise scale (--scale) must be a finite number >= 0, got scale={scale!r}")
        self.scale = float(scale)
        self.seed = seed
        self._generator = torch.Generator().manual_seed(noise_seed(seed))

    def before_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    loss: float) -> None:
        if self.scale == 0:
            return
        for p in model.parameters():
            if p.grad is not None:
                noise = torch.randn(p.grad.shape, generator=self._generator, dtype=torch.float32)
                p.grad.add_(noise.to(device=p.grad.device, dtype=p.grad.dtype), alpha=self.scale)

    def state_dict(self) -> dict[str, Any]:
        """The generator's state: a resumed run draws the noise the uninterrupted one would."""
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"generator"}:
            raise ValueError(f"GradientNoise's state holds {sorted(state)}, not ['generator']: the "
                             "checkpoint was written with other callbacks")
        self._generator.set_state(state["generator"])


class GroupOptions(TrainCallback):
    """Set ``options`` on every projected param group (``rank`` not None) before each step.

    Used for option values that the run config does not carry (the limiter's ``gamma``).
    Raises ValueError at the first step if the optimizer has no projected group.
    """

    def __init__(self, **options: Any) -> None:
        if not options:
            raise ValueError("GroupOptions needs at least one option")
        self.options = options

    def before_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    loss: float) -> None:
        groups = [g for g in optimizer.param_groups if g.get("rank") is not None]
        if not groups:
            raise ValueError(f"GroupOptions({self.options}) found no projected param group in "
                             f"{type(optimizer).__name__}")
        for group in groups:
            for key, value in self.options.items():
                if key not in group:
                    raise ValueError(f"param groups of {type(optimizer).__name__} have no option {key!r}")
                group[key] = value


def global_grad_norm(model: torch.nn.Module) -> float:
    """:math:`\\sqrt{\\sum_p \\|\\nabla_p\\|^2}` over the parameters that have a gradient."""
    norms = [torch.linalg.vector_norm(p.grad.float()) for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def residual_norm(optimizer: torch.optim.Optimizer) -> float | None:
    r""":math:`\sqrt{\sum \|S_t\|^2}` over the projected matrices: the norm of the scaled residual
    after the limiter, which the Fira family keeps as ``prev_norm``; None without such state."""
    norms = [s["prev_norm"] for s in optimizer.state.values() if "prev_norm" in s]
    if not norms:
        return None
    return float(torch.linalg.vector_norm(torch.stack([n.float() for n in norms])))


class NormRecorder(TrainCallback):
    """Write ``{"step", "loss", "grad_norm"[, "residual_norm"]}`` per step to ``path`` (JSONL).

    ``grad_norm`` is the raw gradient's global norm (before clipping and before the step);
    ``residual_norm`` is :func:`residual_norm` after the step (Fira family only).
    """

    def __init__(self, path: str | Path) -> None:
        self.writer = JsonlWriter(path)
        self._grad_norm = float("nan")

    def begin(self, step: int) -> None:
        self.writer.begin(step)

    def before_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    loss: float) -> None:
        self._grad_norm = global_grad_norm(model)

    def after_step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   loss: float) -> None:
        record: dict[str, Any] = {"step": step, "loss": loss, "grad_norm": self._grad_norm}
        residual = residual_norm(optimizer)
        if residual is not None:
            record["residual_norm"] = residual
        self.writer.write(record)


# --------------------------------------------------------------------------- picklable builders

NORMS_FILE = "norms.jsonl"
"""Where :func:`record_norms` writes, in the run's folder."""


def record_norms(run_dir: Path) -> list[TrainCallback]:
    """A :class:`NormRecorder` writing ``run_dir / NORMS_FILE``."""
    return [NormRecorder(run_dir / NORMS_FILE)]


def record_norms_with_noise(run_dir: Path, *, scale: float, seed: int) -> list[TrainCallback]:
    """:func:`record_norms` (the raw gradient, before the noise), then :class:`GradientNoise`."""
    return [NormRecorder(run_dir / NORMS_FILE), GradientNoise(scale, seed)]


def set_options(run_dir: Path, **options: Any) -> list[TrainCallback]:
    """A :class:`GroupOptions` setting ``options`` (``run_dir`` is not used)."""
    return [GroupOptions(**options)]
