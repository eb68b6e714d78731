"""The peers' optional packages: imported without their load-time log noise, and their
optimizers' seeds kept out of a fresh optimizer's state (:func:`with_deferred_seeds`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

#: Loggers that report, at import, on optional parts the harness does not use: bitsandbytes
#: (a dependency of apollo-torch and flora-opt, and imported by peft, so by transformers' Trainer)
#: warns that its CPU 4-bit kernels are missing, flora-opt that JAX is not installed.
IMPORT_LOGGERS = ("bitsandbytes", "flora_opt")


@contextlib.contextmanager
def quiet_import_logs(names: tuple[str, ...] = IMPORT_LOGGERS) -> Iterator[None]:
    """Raise the loggers ``names`` to ERROR while the body runs (errors still show)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def with_deferred_seeds(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``base`` (apollo-torch's ``APOLLOAdamW``, flora-opt's ``Flora``), whose constructor's
    per-parameter ``state["seed"]`` is held back until the first ``step``.

    Both packages fill ``optimizer.state`` with a projection seed per parameter when built, so a
    fresh optimizer does not look empty, and ``torch.distributed.checkpoint``'s state-dict helper
    then skips the zero-gradient step that gives it the keys to load: a DCP resume (DDP runs)
    would load the seeds and drop the moments. Held back, the state is empty until the first
    step, which puts the same seeds in place (a loaded state keeps its own).
    """

    class DeferredSeeds(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._initial_seeds = {p: state.pop("seed") for p, state in self.state.items() if "seed" in state}
            for p in [p for p, state in self.state.items() if not state]:
                del self.state[p]

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            # torch casts every floating-point state to its parameter's dtype: the fp32 moments of
            # bf16 weights (train.param_dtype=bfloat16) came back rounded to bf16, and the resumed
            # run went on from other moments than the one that was not stopped. Each keeps its own.
            super().load_state_dict(state_dict)
            params = {saved_id: p for saved_group, group in zip(state_dict["param_groups"], self.param_groups)
                      for saved_id, p in zip(saved_group["params"], group["params"])}
            for saved_id, saved in state_dict["state"].items():
                state = self.state.get(params.get(saved_id), {})
                for key, value in saved.items():
                    loaded = state.get(key)
                    if (torch.is_tensor(value) and value.is_floating_point() and torch.is_tensor(loaded)
                            and loaded.dtype != value.dtype):
                        state[key] = value.to(device=loaded.device, copy=True)

        def step(self, closure: Any = None) -> Any:
            if self._initial_seeds:
                for p, seed in self._initial_seeds.items():
                    self.state[p].setdefault("seed", seed)
                self._initial_seeds = {}
            return super().step(closure)

    DeferredSeeds.__name__ = DeferredSeeds.__qualname__ = base.__name__
    return DeferredSeeds
