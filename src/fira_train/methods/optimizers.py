"""Factories of the methods that only choose an optimizer: ``torch.optim``'s, Adam-mini's, the
Fira / GaLore family's (``fira_optim.FiraAdamW`` with a variant of :data:`fira_optim.VARIANTS`) and
the paper's other baselines: APOLLO / APOLLO-Mini (:mod:`fira_train.methods.apollo`), Flora
(:mod:`fira_train.methods.flora`) and SlimAdam (:mod:`fira_train.methods.slimadam`)."""

from __future__ import annotations

import warnings
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


def build_adamw_grouped(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """Full-rank ``torch.optim.AdamW`` with Fira's per-group step sizes: the control that separates
    Fira's low-rank machinery from its learning rates.

    The matrices Fira would project (:func:`fira_optim.param_groups`: the attention and MLP
    weights) train at ``optim.alpha * lr``, the rest (embeddings, norms, head) at ``lr`` -- the
    step sizes a Fira run gives them (its projected update is scaled by alpha). With the
    schedulers' per-group ``initial_lr`` the ratio holds at every step.

    Not read: ``optim.rank``. Fira trains a matrix with ``rank >= min(m, n)`` unprojected, with
    plain Adam at ``lr``; here it still steps at ``alpha * lr`` (``1 / alpha`` times smaller than
    Fira's: on ``micro`` at rank 64, every matrix). No recipe has such a matrix; reading the rank
    would make ``adamw-grouped`` a method that uses ``optim.rank`` (its runs' records and
    identities would then carry one).
    """
    o = config.optim
    groups = fira_optim.param_groups(model, rank=1, update_proj_gap=1, alpha=o.alpha)
    # Fira decays every weight by lr * weight_decay (alpha scales the update only): the matrices'
    # decay rate is divided by alpha so that their decay step stays lr * weight_decay.
    adamw_groups = [{"params": g["params"], "lr": lr * o.alpha, "weight_decay": o.weight_decay / o.alpha}
                    if g.get("rank") else {"params": g["params"], "lr": lr} for g in groups]
    return MethodSetup(model, torch.optim.AdamW(adamw_groups, lr=lr, betas=o.betas, eps=o.eps,
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


def _refuse_fsdp2(config: "RunConfig", method: str, why: str) -> None:
    if config.train.parallel == "fsdp2":
        raise ValueError(f"optim.method={method!r} does not run under train.parallel='fsdp2': {why}; "
                         "use train.parallel='ddp' or 'none'")


def build_apollo(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """APOLLO (``apollo-torch``): channel-wise scaling at rank ``optim.rank``, scale 1."""
    return _apollo(model, config, lr, "apollo")


def build_apollo_mini(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """APOLLO-Mini (``apollo-torch``): tensor-wise scaling at rank 1, scale 128."""
    return _apollo(model, config, lr, "apollo-mini")


def _apollo(model: nn.Module, config: "RunConfig", lr: float, variant: str) -> MethodSetup:
    from fira_train.methods.apollo import FSDP2_REASON, build_apollo_optimizer

    _refuse_fsdp2(config, variant, FSDP2_REASON)
    o = config.optim
    optimizer = build_apollo_optimizer(model, variant, lr=lr, rank=o.rank, update_proj_gap=o.update_proj_gap,
                                       betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, seed=config.train.seed)
    return MethodSetup(model, optimizer)


def build_flora(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """Flora (``flora-opt``): momentum compressed at rank ``optim.rank``, resampled every
    ``optim.update_proj_gap`` steps, over every trainable parameter."""
    from fira_train.methods.flora import FSDP2_REASON, build_flora_optimizer

    _refuse_fsdp2(config, "flora", FSDP2_REASON)
    o = config.optim
    optimizer = build_flora_optimizer(model, lr=lr, rank=o.rank, kappa=o.update_proj_gap, beta1=o.betas[0],
                                      weight_decay=o.weight_decay, seed=config.train.seed)
    return MethodSetup(model, optimizer)


def build_slimadam(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """SlimAdam (written here): AdamW with the second moment averaged per the paper's Table 1."""
    from fira_train.methods.slimadam import FSDP2_REASON, SlimAdamW, slimadam_param_groups

    _refuse_fsdp2(config, "slimadam", FSDP2_REASON)
    o = config.optim
    optimizer = SlimAdamW(slimadam_param_groups(model), lr=lr, betas=o.betas, eps=o.eps,
                          weight_decay=o.weight_decay)
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
                   "state_rounding": o.state_rounding, "stochastic_rounding": o.stochastic_rounding,
                   **fira_optim.VARIANTS[variant]}
        if o.align_signs is not None:  # one that contradicts the variant is refused by the config
            options["align_signs"] = o.align_signs
        with warnings.catch_warnings():
            # said once per parameter group and in the optimizer's terms: once below, in the config's
            warnings.filterwarnings("ignore", message=r"param_groups\[\d+\] holds no bfloat16 parameter",
                                    category=UserWarning)
            optimizer = fira_optim.FiraAdamW(
                groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                seed=config.train.seed, split_refresh=split_refresh, **options,
            )
        if o.stochastic_rounding and not any(p.dtype == torch.bfloat16 for group in optimizer.param_groups
                                             for p in group["params"]):
            warnings.warn(f"optim.stochastic_rounding=true changes nothing with train.param_dtype="
                          f"{config.train.param_dtype!r}: it rounds the updates of bfloat16 weights "
                          "(train.param_dtype=bfloat16)", UserWarning, stacklevel=2)
        return MethodSetup(model, optimizer)

    return build
