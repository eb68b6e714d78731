"""APOLLO and APOLLO-Mini (Zhu et al., 2024, "APOLLO: SGD-like Memory, AdamW-level Performance")
from the authors' package ``apollo-torch`` (PyPI 1.0.3), used as a dependency: its licence is
CC-BY-NC-4.0, and no line of it is copied here.

APOLLO projects the gradient ``G`` (``m x n``) of each attention / MLP matrix with a *random*
Gaussian matrix (no SVD) to ``R`` (``r x n`` for ``m < n``), runs Adam's two moments on ``R``,
and scales the *full* gradient by the ratio of norms ``||Adam(R)|| / ||R||``: per channel
(``scale_type="channel"``, APOLLO) or per tensor (``"tensor"``, APOLLO-Mini); the scaled
gradient passes through Fira's norm-growth limiter (gamma 1.01) and is multiplied by
``sqrt(scale)``. The random matrix is redrawn from a new seed every ``update_proj_gap`` steps.
Embeddings, norms and the head get plain AdamW (the package's groups without a ``rank`` key).

The published settings (the package README, "Hyperparameter choices" and "Benchmark 1"), held in
:data:`SETTINGS`:

- ``apollo``: ``scale_type="channel"``, ``scale=1`` ("Default value for APOLLO"), rank "1/4 of
  the original dim ... (same as Galore)" -- the harness's ``optim.rank``, which the recipes set
  to d/4 (``tiny``, ``micro``, ``60m``, ``350m``, ``1b``), except ``130m`` (256 / 768 = d/3) and
  ``7b`` (64 / 4096): the paper's GaLore ranks 128 / 256 / 256 / 512, APOLLO's pre-training ranks;
  ``scale_front=False`` (the limiter acts before the scale, the package default);
- ``apollo-mini``: rank 1, ``scale_type="tensor"``, ``scale=128`` ("Default value for
  APOLLO-Mini"), ``scale_front=True`` (the README recommends it "when training involves fewer
  warmup steps, e.g., LLaMA 60M and 130M with APOLLO-Mini"; the CPU recipes are smaller still);
- both: ``proj="random"``, ``proj_type="std"`` (project the smaller side), ``update_proj_gap``
  = ``optim.update_proj_gap`` (the README's 200, as the paper recipes), learning rate 0.01 (the
  README's usage example ``APOLLO(param_groups, lr=0.01)``; its long-context benchmark keeps
  "the learning rate fixed at 1e-2" for both).

Where the package's arithmetic differs from a bias-corrected Adam (kept: the harness runs the
authors' package, whose arithmetic produced their numbers), and what the harness passes it:

- Adam's bias correction is folded into the step size: ``lr * sqrt(1 - beta2^t) / (1 - beta1^t)``
  multiplies the whole update, so the channel factor ``||Adam(R)|| / ||R||`` and the norm-growth
  limiter see *un-corrected* moments ``M / (sqrt(V) + eps)``. Their size grows over the first
  steps (for a steady gradient, 3.2 at t = 1 and 4.3 at t = 2 with the default betas, where the
  corrected moments give 1 at every step: ``(1 - beta1^t) / sqrt(1 - beta2^t)``), which the limiter,
  allowing 1.01x per step, cuts back: the early updates are smaller than those of a limiter on
  corrected moments (the placement of Fira's Algorithm 1 and of ``fira_optim``'s Fira). The
  harness's build matches a float64 transcription of the package's arithmetic
  (``tests/fira_train/methods/test_peers.py``).
- Weight decay comes after the update, at the uncorrected ``lr`` (``p -= lr * wd * p``), on every
  parameter; the AdamW group (embeddings, norms, head) adds ``eps`` before the bias correction
  (Hugging Face's AdamW), as ``fira`` 1.0.2 and galore-torch do.
- ``eps`` is ``optim.eps``, 1e-8 by default (torch's AdamW, shared by every method of the harness);
  the package defaults to 1e-6 and the README's usage example keeps that default. It matters where
  ``sqrt(v)`` is small beside 1e-6 (small gradients, early steps); give ``optim.eps=1e-6`` to run
  the package as its authors did.

What the package cannot do here, refused with a clear error: FSDP2 (the README's to-do list
says "Support APOLLO with FSDP"; the step multiplies plain random matrices with the sharded
DTensor gradients). It runs on the CPU (its random matrices come from a ``torch.Generator`` on
the gradient's device) and under DDP (every rank draws the same matrices from the same seeds).

The package keeps one Python ``GradientProjector`` object per matrix in the optimizer state,
which ``torch.load(weights_only=True)`` refuses; :func:`apollo_optimizer` returns a subclass
whose ``state_dict`` stores the projector's attributes (numbers, a string and the current
random matrix) instead, and rebuilds the object on ``load_state_dict``. It also holds back the
seeds the package puts in a fresh optimizer's state (:func:`fira_train.methods.packages.
with_deferred_seeds`), without which a DDP run's (DCP) checkpoint would resume without moments.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

import fira_optim
from fira_train.methods.packages import quiet_import_logs, with_deferred_seeds

#: The package version the settings were read from (``pyproject.toml`` pins it in ``[train]``).
PACKAGE = "apollo-torch==1.0.3"

#: Method -> APOLLO group settings; ``rank=None`` means ``optim.rank``.
SETTINGS: dict[str, dict[str, Any]] = {
    "apollo": {"rank": None, "scale_type": "channel", "scale": 1.0, "scale_front": False},
    "apollo-mini": {"rank": 1, "scale_type": "tensor", "scale": 128.0, "scale_front": True},
}
#: The README's learning rate for both.
DEFAULT_LR = 0.01
#: Why ``train.parallel="fsdp2"`` is refused.
FSDP2_REASON = ("apollo-torch 1.0.3 multiplies plain random matrices with the sharded (DTensor) gradients, "
                "and its README lists FSDP support as to do")


def _import_package() -> tuple[type, type]:
    try:
        with quiet_import_logs():
            from apollo_torch import APOLLOAdamW
            from apollo_torch.random_projector import GradientProjector
    except ImportError as err:
        raise ImportError(
            f"the apollo methods need the package {PACKAGE!r} and its dependency bitsandbytes "
            f"(pip install '{PACKAGE}', or fira-optim's [train] extra): {err}"
        ) from err
    return APOLLOAdamW, GradientProjector


def _pack(state: dict[str, Any]) -> dict[str, Any]:
    projector = state.get("projector")
    if projector is None or isinstance(projector, dict):
        return state
    return {**state, "projector": dict(vars(projector))}


@functools.cache
def weights_only_class() -> type[torch.optim.Optimizer]:
    """``apollo_torch.APOLLOAdamW`` with a state dict of tensors and plain values only."""
    base, projector_class = _import_package()

    class WeightsOnlyAPOLLO(with_deferred_seeds(base)):  # type: ignore[misc]
        """``apollo_torch.APOLLOAdamW``; its projectors are saved as dictionaries of their attributes.
        ``seed`` (the run's) shifts the package's projection seeds: it seeds parameter ``i`` with
        ``i`` alone, so every run seed drew the same random matrices. With ``seed`` they are
        ``i + seed * n`` (``n`` parameters): the package's own at seed 0, distinct per seed."""

        def __init__(self, *args: Any, seed: int = 0, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            count = len(self._initial_seeds)
            self._initial_seeds = {p: s + seed * count for p, s in self._initial_seeds.items()}

        def state_dict(self) -> dict[str, Any]:
            saved = super().state_dict()
            saved["state"] = {key: _pack(value) for key, value in saved["state"].items()}
            return saved

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            # The projectors stay out of torch's loading, whose casting turns strings into
            # generators; each is rebuilt here, its random matrix moved to the parameter's device.
            saved = state_dict["state"]
            projectors = {key: value["projector"] for key, value in saved.items()
                          if isinstance(value.get("projector"), dict)}
            stripped = {key: {k: v for k, v in value.items() if k != "projector"} if key in projectors else value
                        for key, value in saved.items()}
            super().load_state_dict({**state_dict, "state": stripped})
            params = {saved_id: p for saved_group, group in zip(state_dict["param_groups"], self.param_groups)
                      for saved_id, p in zip(saved_group["params"], group["params"])}
            for key, attributes in projectors.items():
                p = params[key]
                projector = projector_class.__new__(projector_class)
                projector.__dict__.update(attributes)
                if isinstance(projector.__dict__.get("ortho_matrix"), torch.Tensor):
                    projector.ortho_matrix = projector.ortho_matrix.to(p.device)
                self.state[p]["projector"] = projector

    WeightsOnlyAPOLLO.__name__ = WeightsOnlyAPOLLO.__qualname__ = "APOLLOAdamW"
    return WeightsOnlyAPOLLO


def apollo_groups(projected: list[torch.Tensor], regular: list[torch.Tensor], *, rank: int, scale_type: str,
                  scale: float, update_proj_gap: int) -> list[dict[str, Any]]:
    """The package's param groups: ``regular`` (AdamW: no ``rank`` key) and ``projected``."""
    groups: list[dict[str, Any]] = []
    if regular:
        groups.append({"params": regular})
    if projected:
        groups.append({"params": projected, "rank": rank, "proj": "random", "scale_type": scale_type,
                       "scale": scale, "update_proj_gap": update_proj_gap, "proj_type": "std"})
    return groups


def apollo_optimizer(groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], eps: float,
                     weight_decay: float, scale_front: bool, seed: int = 0) -> torch.optim.Optimizer:
    """The package's ``APOLLOAdamW`` over ``groups`` (from :func:`apollo_groups`), weights-only
    state, its random projections drawn from the run's ``seed``."""
    return weights_only_class()(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                correct_bias=True, scale_front=scale_front, disable_nl=False, seed=seed)


def split_matrices(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(attention / MLP ``nn.Linear`` weights, everything else trainable): Fira's split
    (:func:`fira_optim.param_groups`: never embeddings, the head or 1-D tensors)."""
    projected: list[torch.Tensor] = []
    regular: list[torch.Tensor] = []
    for group in fira_optim.param_groups(model, rank=1):
        (regular if group["rank"] is None else projected).extend(group["params"])
    return projected, regular


def build_apollo_optimizer(model: nn.Module, variant: str, *, lr: float, rank: int, update_proj_gap: int,
                           betas: tuple[float, float], eps: float, weight_decay: float,
                           scale: float | None = None, seed: int = 0) -> torch.optim.Optimizer:
    """APOLLO (``variant="apollo"``, at ``rank``) or APOLLO-Mini (``"apollo-mini"``, rank 1) over
    ``model``'s attention / MLP matrices, AdamW on the rest; ``scale`` overrides the setting's."""
    settings = SETTINGS[variant]
    projected, regular = split_matrices(model)
    groups = apollo_groups(projected, regular, rank=settings["rank"] or rank, scale_type=settings["scale_type"],
                           scale=settings["scale"] if scale is None else scale,
                           update_proj_gap=update_proj_gap)
    return apollo_optimizer(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            scale_front=settings["scale_front"], seed=seed)


__all__ = [
    "DEFAULT_LR",
    "FSDP2_REASON",
    "PACKAGE",
    "SETTINGS",
    "apollo_groups",
    "apollo_optimizer",
    "build_apollo_optimizer",
    "split_matrices",
    "weights_only_class",
]
