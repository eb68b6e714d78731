"""Factories of the methods that only choose an optimizer: ``torch.optim``'s, Adam-mini's and the
Fira / GaLore family's (``fira_optim.FiraAdamW`` with a variant of :data:`fira_optim.VARIANTS`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

import fira_optim
from fira_train.methods.method import MethodSetup

if TYPE_CHECKING:  # annotations only: the config validates method names against the registry
    from fira_train.config.run_config import RunConfig


def build_adamw(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """``torch.optim.AdamW`` over the trainable parameters."""
    o = config.optim
    params = [p for p in model.parameters() if p.requires_grad]
    return MethodSetup(model, torch.optim.AdamW(params, lr=lr, betas=o.betas, eps=o.eps,
                                                weight_decay=o.weight_decay))


def build_sgd(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """``torch.optim.SGD`` with momentum ``betas[0]``."""
    o = config.optim
    params = [p for p in model.parameters() if p.requires_grad]
    return MethodSetup(model, torch.optim.SGD(params, lr=lr, momentum=o.betas[0],
                                              weight_decay=o.weight_decay))


def build_adagrad(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """``torch.optim.Adagrad``."""
    o = config.optim
    params = [p for p in model.parameters() if p.requires_grad]
    return MethodSetup(model, torch.optim.Adagrad(params, lr=lr, eps=o.eps, weight_decay=o.weight_decay))


def build_adam_mini(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """Adam-mini (the ``adam-mini`` package), told the model's width and heads."""
    from adam_mini import Adam_mini  # only this method needs it, and it takes a second to import

    o, m = config.optim, config.model
    # Adam-mini partitions the weights into blocks by parameter name (embed, q/k per head,
    # v/o/mlp per neuron), so it needs the architecture's width and head counts.
    optimizer = Adam_mini(
        named_parameters=[(n, p) for n, p in model.named_parameters() if p.requires_grad],
        lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
        dim=m.hidden_size, n_heads=m.num_attention_heads,
        n_kv_heads=m.num_key_value_heads or m.num_attention_heads, verbose=False,
    )
    return MethodSetup(model, optimizer)


def fira_family(variant: str) -> Callable[[nn.Module, "RunConfig", float], MethodSetup]:
    """The factory of the Fira / GaLore variant ``variant`` (a key of :data:`fira_optim.VARIANTS`)."""
    def build(model: nn.Module, config: "RunConfig", lr: float, split_refresh: bool = False) -> MethodSetup:
        o = config.optim
        groups = fira_optim.param_groups(model, rank=o.rank, update_proj_gap=o.update_proj_gap,
                                         alpha=o.alpha)
        # The variant's own settings (e.g. fira-only-scaling-random's projector) win.
        options = {"gamma": o.gamma, "projector": o.projector, "implementation": o.implementation,
                   "host_refresh": o.host_refresh, "state_dtype": o.state_dtype,
                   "stochastic_rounding": o.stochastic_rounding, **fira_optim.VARIANTS[variant]}
        optimizer = fira_optim.FiraAdamW(
            groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
            seed=config.train.seed, split_refresh=split_refresh, **options,
        )
        return MethodSetup(model, optimizer)

    return build
