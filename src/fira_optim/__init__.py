"""fira-optim: Fira (full-rank training under a low-rank optimizer-state constraint) for PyTorch.

Depends on torch alone. Start with :class:`FiraAdamW` and :func:`param_groups`.
"""

from .backward import StepInBackward, step_in_backward
from .groups import divide_params, param_groups
from .loss_scale import LossScale
from .optimizer import Fira, FiraAdamW, GaLoreAdamW, NonFiniteGradientError
from .pipeline import MatrixStats
from .state import optimizer_state_numel
from .variants import VARIANTS

__all__ = [
    "Fira",
    "MatrixStats",
    "FiraAdamW",
    "GaLoreAdamW",
    "LossScale",
    "NonFiniteGradientError",
    "StepInBackward",
    "VARIANTS",
    "divide_params",
    "optimizer_state_numel",
    "param_groups",
    "step_in_backward",
]
__version__ = "0.1.0"
