"""Flora (Hao, Cao and Mou, ICML 2024, "Flora: Low-Rank Adapters Are Secretly Gradient
Compressors") from the authors' package ``flora-opt`` (PyPI 0.0.3, ``flora_opt.Flora``; LGPL-3.0),
used as a dependency.

Flora is Adafactor (factored second moment, update clipping, step size relative to the
parameter's RMS) with momentum whose first moment is kept *compressed* by a random Gaussian
projection: ``r x n`` (``m < n``) or ``m x r`` instead of ``m x n``, decompressed with the same
matrix for the update. Every ``kappa`` steps the projection is redrawn from a new seed and the
compressed momentum is carried over (decompressed with the old matrix, compressed with the new),
so the sum of the updates is not confined to one rank-``r`` subspace. The package compresses the
momentum of a 2-D tensor when ``r <= min(m, n)`` and ``max(m, n) / min(m, n) <= 4`` (its
"rule out embeddings"); other tensors keep a full first moment. Every trainable parameter goes
to the one optimizer, as in the package's examples.

Settings (:func:`build_flora_optimizer`): ``rank`` = ``optim.rank``, ``kappa`` (the resampling
interval T) = ``optim.update_proj_gap``, ``beta1`` = ``optim.betas[0]`` (0.9, the ``b1`` of the
package's ``configs/optimizer/flora.yaml`` and its momentum experiments); the rest are the
package's defaults (the same as that config): ``decay_rate=-0.8``, ``eps=(1e-30, 1e-3)``,
``clip_threshold=1.0``, ``scale_parameter=True``, ``relative_step=False`` (the harness's schedule
sets the learning rate), no 8-bit quantization of the states. Weight decay (``optim.weight_decay``,
0 in the paper's runs) is the package's: ``W -= weight_decay * lr * max(1e-3, RMS(W)) * W``, at
Adafactor's parameter-relative step size, before the update.

The package's algorithm: Adafactor's factored second moment with decay ``1 - t^-0.8``, momentum
of the normalised update kept compressed through a Gaussian matrix scaled by ``1 / sqrt(r)``,
moved to the new matrix after steps ``kappa, 2 kappa, ...``, update clipping at RMS 1.
:func:`build_flora_optimizer` at run seed 0 steps as the package's ``Flora`` over the same
parameters, bit for bit (``tests/fira_train/methods/test_peers.py``).

What is used of the package: the ``Flora`` optimizer, i.e. the compressed momentum. Flora's
other half, compressing the *gradient accumulation* across micro-batches, lives in the package's
``FloraAccelerator`` (an ``accelerate.Accelerator`` that steps from post-accumulate-grad hooks),
which cannot drive this harness's own training loop: micro-batch gradients accumulate in full
``m x n`` as for every other method. Not supported: FSDP2 (the projections are plain tensors
multiplied with sharded DTensor gradients); refused with a clear error. DDP and the CPU work.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from fira_train.methods.packages import quiet_import_logs, with_deferred_seeds

#: The package version read (``pyproject.toml`` pins it in ``[train]``).
PACKAGE = "flora-opt[torch]==0.0.3"
#: Why ``train.parallel="fsdp2"`` is refused.
FSDP2_REASON = "flora-opt 0.0.3 multiplies plain random matrices with the sharded (DTensor) gradients"


@functools.cache
def _import_flora() -> type[torch.optim.Optimizer]:
    """``flora_opt.Flora``, its seeds held back until the first step (so that a DDP run's DCP
    checkpoint resumes with the moments: :func:`fira_train.methods.packages.with_deferred_seeds`)."""
    try:
        with quiet_import_logs():
            from flora_opt.optimizers.torch.flora import Flora
    except ImportError as err:
        raise ImportError(
            f"the flora method needs the package {PACKAGE!r} (with its dependencies accelerate and "
            f"bitsandbytes: pip install '{PACKAGE}', or fira-optim's [train] extra): {err}"
        ) from err
    return with_deferred_seeds(Flora)


def trainable_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The trainable parameters, a tied tensor once."""
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def flora_optimizer(params: Any, *, lr: float, rank: int, kappa: int, beta1: float, weight_decay: float,
                    seed: int = 0) -> torch.optim.Optimizer:
    """``flora_opt.Flora`` with the settings of the module docstring."""
    flora = _import_flora()
    return flora(params, lr=lr, rank=rank, kappa=kappa, beta1=beta1, weight_decay=weight_decay, seed=seed,
                 eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, scale_parameter=True,
                 relative_step=False, warmup_init=False, factorize_second_moment=True, quantization=False)


def build_flora_optimizer(model: nn.Module, *, lr: float, rank: int, kappa: int, beta1: float,
                          weight_decay: float, seed: int = 0) -> torch.optim.Optimizer:
    """Flora over every trainable parameter of ``model``, its projections drawn from the run's
    ``seed``. The package seeds parameter ``i`` (from 1) with ``seed + i``, so run seed 1's
    first parameter drew run seed 0's second one's matrices; it is given ``seed * (n + 1)`` for
    ``n`` parameters instead, the package's own at seed 0 and disjoint between run seeds."""
    params = trainable_parameters(model)
    return flora_optimizer(params, lr=lr, rank=rank, kappa=kappa, beta1=beta1,
                           weight_decay=weight_decay, seed=seed * (len(params) + 1))


def compresses_momentum(shape: tuple[int, ...], rank: int) -> bool:
    """Whether Flora keeps a compressed first moment for a tensor of ``shape`` (the package's rule)."""
    if len(shape) != 2:
        return False
    small, large = min(shape), max(shape)
    return small >= rank and large / small <= 4


__all__ = [
    "FSDP2_REASON",
    "PACKAGE",
    "build_flora_optimizer",
    "compresses_momentum",
    "flora_optimizer",
    "trainable_parameters",
]
