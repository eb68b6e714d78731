"""What a checkpoint holds, and seeding: everything a run needs to continue exactly.

A checkpoint payload (:func:`capture_state`) has the model, optimizer and scheduler state
dicts, the data stream position (``BatchStream.state_dict()``), the Python, NumPy, torch and
CUDA generator states, the step and the run's running totals (tokens, training time). It holds
tensors and plain Python values only, so ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fira_train.checkpoint import CheckpointError

if TYPE_CHECKING:
    from fira_train.train import Training


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and every CUDA device) generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def capture_state(step: int, training: Training, stream: Any, progress: dict[str, float]) -> dict[str, Any]:
    """The checkpoint payload: tensors and plain Python values only (``weights_only`` loads it)."""
    return {
        "step": step,
        "model": training.model.state_dict(),
        "optimizer": training.optimizer.state_dict(),
        "scheduler": training.scheduler.state_dict(),
        "data": stream.state_dict(),
        "rng": _rng_state(),
        "progress": dict(progress),
    }


def restore_state(state: dict[str, Any], training: Training, stream: Any) -> tuple[int, dict[str, float]]:
    """Load a checkpoint payload into freshly built objects; returns (step, progress)."""
    missing = {"step", "model", "optimizer", "scheduler", "data", "rng", "progress"} - set(state)
    if missing:
        raise CheckpointError(f"checkpoint lacks {sorted(missing)}")
    training.model.load_state_dict(state["model"])
    training.optimizer.load_state_dict(state["optimizer"])
    training.scheduler.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["data"])
    _set_rng_state(state["rng"])
    return int(state["step"]), dict(state["progress"])
