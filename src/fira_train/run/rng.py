"""The random generators a run draws from (Python, NumPy, torch CPU and CUDA): seeding, and their
states as tensors and plain values, which ``torch.load(weights_only=True)`` reads back.

Two checkpoint formats hold these states, each in its own layout (checkpoints of both exist, so
both layouts stay): :func:`rng_state` for the one-process checkpoints (every CUDA device) and
:func:`rank_rng_state` for each rank's entry in the distributed ones (this rank's CUDA device).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and every CUDA device) generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every generator's state: the ``rng`` entry of a one-process checkpoint."""
    keys, pos, has_gauss, cached_gaussian = _numpy_state()
    return {
        "python": random.getstate(),
        "numpy": {"keys": keys, "pos": pos, "has_gauss": has_gauss, "cached_gaussian": cached_gaussian},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    _set_python_state(state["python"])
    n = state["numpy"]
    _set_numpy_state(n["keys"], n["pos"], n["has_gauss"], n["cached_gaussian"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_rng_state() -> dict[str, Any]:
    """This rank's generators: torch (CPU, and this rank's CUDA device once CUDA is initialised),
    Python and NumPy, in the layout of a distributed checkpoint's per-rank entry."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    state["numpy"] = list(_numpy_state())
    return state


def set_rank_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rank_rng_state` captured (the generators it holds; a checkpoint written
    on CPU has no CUDA state)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "python" in state:
        _set_python_state(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
    if "numpy" in state:
        _set_numpy_state(*state["numpy"])


def _numpy_state() -> tuple[torch.Tensor, int, int, float]:
    """NumPy's global Mersenne Twister: (keys as an int64 tensor, position, has_gauss, cached)."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian)


def _set_numpy_state(keys: torch.Tensor, pos: int, has_gauss: int, cached_gaussian: float) -> None:
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))


def _set_python_state(state: Any) -> None:
    """``random.setstate`` from a saved state, whose tuples may have come back as lists."""
    random.setstate(_as_tuple(state))


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
