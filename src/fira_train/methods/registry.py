"""The method registry: one name -> one factory that builds the optimizer (and wraps the model).

Every training method of the paper's comparison and ablations is a :class:`Method` in
:data:`METHODS`, used identically by ``fira-train pretrain --method NAME`` and by ``compare``
(``fira-train finetune`` offers four of them, and two of its own: the view
:data:`fira_train.finetune.config.METHODS`):

- ``adamw``: full-rank ``torch.optim.AdamW``;
- ``fira`` and every variant of :data:`fira_optim.VARIANTS` (``fira-matrix``, ``fira-no-scaling``,
  ``fira-no-limiter``, ``fira-clip``, ``fira-shrink``, ``fira-tensorwise``, ``fira-only-scaling``,
  ``fira-only-scaling-random``, ``fira-released``, ``galore``, ``galore-add``, ``fira-adagrad``,
  ``galore-adagrad``, ``fira-rmsprop``, ``galore-rmsprop``, ``frugal``):
  ``fira_optim.FiraAdamW(param_groups(model, rank, T, alpha), lr, **VARIANTS[name])`` -- the
  attention and MLP matrices are projected, embeddings, norms and the head get plain AdamW;
- ``lora``: ``peft`` LoRA adapters of rank r on every attention and MLP matrix; as in the
  pre-training baselines of GaLore and ReLoRA, embeddings, norms and the head train in full;
- ``relora``: ``lora`` whose adapters are merged into the weights and re-initialised every
  ``optim.relora_every`` steps, the adapters' Adam moments magnitude-pruned
  (``optim.relora_prune``, 0.99 as in the ReLoRA paper) and the learning rate re-warmed
  (a jagged cosine schedule). ReLoRA's initial full-rank warm start is not reproduced;
- ``sgd`` (momentum ``betas[0]``), ``adagrad``: ``torch.optim``;
- ``adam-mini``: the ``adam-mini`` package (``Adam_mini``), told the model's width and heads.

Default learning rates (``optim.lr=None``): 0.01 for every Fira/GaLore-family name (the paper
uses 0.01 for Fira and GaLore without tuning); 0.001 for ``adamw``, ``lora``, ``relora`` and
``adam-mini`` (the best value of the paper's grid {0.01, 0.005, 0.001, 0.0005, 0.0001} for the
full-rank and LoRA baselines in GaLore's tuning, and Adam-mini's recommendation to reuse AdamW's);
0.01 for ``adagrad`` (``torch.optim.Adagrad``'s default, also the best of {0.03, 0.01, 0.003} on
``micro``); 0.03 for ``sgd`` (no paper value: the best of {1, 0.3, 0.1, 0.03, 0.01, 0.003} in a
60-step ``micro`` run on a synthetic corpus, 1 diverged; a smoke-level choice, tune it on real data).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

import fira_optim
from fira_train.methods.lora import build_lora, build_relora
from fira_train.methods.method import Method, MethodSetup
from fira_train.methods.optimizers import build_adagrad, build_adam_mini, build_adamw, build_sgd, fira_family

if TYPE_CHECKING:  # annotations only: the config validates method names against the registry
    from fira_train.config.run_config import RunConfig


def resolved_lr(config: "RunConfig") -> float:
    """``config.optim.lr``, or the method's default when it is None."""
    return config.optim.lr if config.optim.lr is not None else get_method(config.optim.method).default_lr


def build_method(model: nn.Module, config: "RunConfig", *, split_refresh: bool = False) -> MethodSetup:
    """Build ``config.optim.method`` for ``model``.

    ``split_refresh=True`` (a DDP run) is passed on to the methods that accept it
    (:attr:`Method.split_refresh`) and ignored by the others.
    """
    method = get_method(config.optim.method)
    if split_refresh and method.split_refresh:
        return method.build(model, config, resolved_lr(config), split_refresh=True)
    return method.build(model, config, resolved_lr(config))


def get_method(name: str) -> Method:
    """The registry entry ``name``; ValueError listing every valid name otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(METHODS)}")
    return METHODS[name]


FIRA_LR = 0.01

METHODS: dict[str, Method] = {
    "adamw": Method("adamw", 1e-3, build_adamw, "full-rank AdamW (torch.optim.AdamW)"),
}
for _name, _overrides in fira_optim.VARIANTS.items():
    _what = ", ".join(f"{k}={v!r}" for k, v in _overrides.items()) or "the paper's Fira"
    METHODS[_name] = Method(_name, FIRA_LR, fira_family(_name),
                            f"fira_optim.FiraAdamW with {_what}", uses_rank=True, split_refresh=True)
METHODS.update({
    "lora": Method("lora", 1e-3, build_lora, "peft LoRA on attention + MLP, the rest trained in full",
                   uses_rank=True, wraps_model=True),
    "relora": Method("relora", 1e-3, build_relora,
                     "LoRA merged and restarted periodically, moments pruned, jagged LR", uses_rank=True,
                     wraps_model=True),
    "sgd": Method("sgd", 0.03, build_sgd, "torch.optim.SGD with momentum betas[0]"),
    "adagrad": Method("adagrad", 1e-2, build_adagrad, "torch.optim.Adagrad"),
    "adam-mini": Method("adam-mini", 1e-3, build_adam_mini, "Adam-mini (the adam-mini package)"),
})
