"""Every method of the paper as a setting of the one optimizer class.

``VARIANTS[name]`` holds the keyword overrides of :class:`fira_optim.FiraAdamW` that turn Fira
into the named method (the names are the ones the ``fira-train`` CLI accepts).
"""

from __future__ import annotations

from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    # Fira (column-level scaling, norm-growth limiter, Adam in the subspace).
    "fira": {},
    # Section 5.4 ablations.
    "fira-matrix": {"scaling": "matrix"},
    "fira-no-scaling": {"scaling": "none"},
    "fira-no-limiter": {"limiter": "none"},
    "fira-clip": {"limiter": "clip"},
    "fira-shrink": {"limiter": "shrink"},
    "fira-tensorwise": {"limiter": "tensorwise"},
    # Appendix E: W -= lr * phi(R) * G, with and without SVD.
    "fira-only-scaling": {"only_scaling": True},
    "fira-only-scaling-random": {"only_scaling": True, "projector": "random"},
    # The released fira 1.0.2: its arithmetic (residual G - alpha P R, ...) and raw SVD signs.
    "fira-released": {"arithmetic": "released", "align_signs": False},
    # GaLore, and GaLore-add (raw residual: no scaling, no limiter; Eqn. 9).
    "galore": {"residual": "drop"},
    "galore-add": {"scaling": "none", "limiter": "none"},
    # Plug-and-play bases (the paper's Adagrad table).
    "fira-adagrad": {"base": "adagrad"},
    "galore-adagrad": {"base": "adagrad", "residual": "drop"},
    "fira-rmsprop": {"base": "rmsprop"},
    "galore-rmsprop": {"base": "rmsprop", "residual": "drop"},
    # FRUGAL: GaLore in the subspace plus signSGD outside it.
    "frugal": {"residual": "sign", "limiter": "none"},
}
