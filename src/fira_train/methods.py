"""The method registry: one name -> one factory that builds the optimizer (and wraps the model).

Every training method of the paper's comparison and ablations is a :class:`Method` in
:data:`METHODS`, used identically by ``fira-train pretrain --method NAME`` and by ``compare``:

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

import fira_optim

if TYPE_CHECKING:
    from fira_train.config import RunConfig

#: The LLaMA linear layers that LoRA adapts and Fira/GaLore project.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class MethodSetup:
    """What a method factory returns to the training loop."""

    model: nn.Module
    """The model to train (the input model, or a ``peft`` wrapper of it)."""
    optimizer: torch.optim.Optimizer
    """The optimizer over the model's trainable parameters."""
    after_step: Callable[[int], None] | None = None
    """Called with the number of completed optimizer steps after each step (ReLoRA's restarts)."""
    restart_every: int | None = None
    """If set, the schedule re-warms the learning rate after every this many steps."""
    rewarmup: int = 1
    """Length of that re-warm-up in steps."""


@dataclass(frozen=True)
class Method:
    """A registry entry."""

    name: str
    default_lr: float
    build: Callable[[nn.Module, "RunConfig", float], MethodSetup]
    """``build(model, config, lr)``: the model (possibly wrapped) and its optimizer."""
    description: str
    uses_rank: bool = False
    """Whether ``optim.rank`` (and for the Fira family ``optim.update_proj_gap``) matter."""
    wraps_model: bool = False
    """Whether ``build`` returns a wrapper of the model (``peft`` adapters) rather than the model."""
    split_refresh: bool = False
    """Whether ``build`` accepts ``split_refresh=`` (``fira_optim.FiraAdamW``'s option that deals
    the refresh SVDs to the ranks of a DDP run)."""


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


# ---------------------------------------------------------------------------------------------
# factories


def _adamw(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    o = config.optim
    params = [p for p in model.parameters() if p.requires_grad]
    return MethodSetup(model, torch.optim.AdamW(params, lr=lr, betas=o.betas, eps=o.eps,
                                                weight_decay=o.weight_decay))


def _sgd(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    o = config.optim
    params = [p for p in model.parameters() if p.requires_grad]
    return MethodSetup(model, torch.optim.SGD(params, lr=lr, momentum=o.betas[0],
                                              weight_decay=o.weight_decay))


def _adagrad(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    o = config.optim
    params = [p for p in model.parameters() if p.requires_grad]
    return MethodSetup(model, torch.optim.Adagrad(params, lr=lr, eps=o.eps, weight_decay=o.weight_decay))


def _adam_mini(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    from adam_mini import Adam_mini

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


def _fira_family(variant: str) -> Callable[[nn.Module, "RunConfig", float], MethodSetup]:
    def build(model: nn.Module, config: "RunConfig", lr: float, split_refresh: bool = False) -> MethodSetup:
        o = config.optim
        groups = fira_optim.param_groups(model, rank=o.rank, update_proj_gap=o.update_proj_gap,
                                         alpha=o.alpha)
        # The variant's own settings (e.g. fira-only-scaling-random's projector) win.
        options = {"gamma": o.gamma, "projector": o.projector, "implementation": o.implementation,
                   "host_refresh": o.host_refresh, **fira_optim.VARIANTS[variant]}
        optimizer = fira_optim.FiraAdamW(
            groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
            seed=config.train.seed, split_refresh=split_refresh, **options,
        )
        return MethodSetup(model, optimizer)

    return build


def _wrap_lora(model: nn.Module, config: "RunConfig") -> nn.Module:
    from peft import LoraConfig, get_peft_model

    o = config.optim
    lora = LoraConfig(r=o.rank, lora_alpha=o.lora_alpha, lora_dropout=o.lora_dropout,
                      target_modules=list(LORA_TARGETS), bias="none")
    wrapped = get_peft_model(model, lora)
    # peft freezes every base weight; in pre-training only the adapted matrices stay frozen.
    for name, p in wrapped.named_parameters():
        if "lora_" not in name and not name.endswith("base_layer.weight"):
            p.requires_grad_(True)
    return wrapped


def _lora(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    wrapped = _wrap_lora(model, config)
    return MethodSetup(wrapped, _adamw(wrapped, config, lr).optimizer)


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """The ``peft`` LoRA layers of ``model`` (modules holding ``lora_A`` / ``lora_B``)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and "default" in m.lora_A]


@torch.no_grad()
def merge_and_reinit_lora(model: nn.Module) -> list[nn.Parameter]:
    r"""ReLoRA's restart: :math:`W \leftarrow W + s\,BA`, then :math:`A` re-drawn, :math:`B = 0`.

    ``A`` is re-initialised like peft's default (Kaiming-uniform, ``a = sqrt(5)``) from the
    global torch generator, so a resumed run (which restores that generator) restarts
    identically. Returns the adapter parameters whose optimizer state should be pruned.
    """
    adapters = []
    for layer in lora_layers(model):
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        base = layer.get_base_layer().weight
        base.add_((b.float() @ a.float()).mul_(layer.scaling["default"]).to(base.dtype))
        nn.init.kaiming_uniform_(a, a=5 ** 0.5)
        nn.init.zeros_(b)
        adapters += [a, b]
    return adapters


@torch.no_grad()
def prune_moments(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], fraction: float) -> None:
    """Zero the ``fraction`` smallest-magnitude entries of every state tensor of ``params``
    (ReLoRA's magnitude pruning of Adam's moments); ``fraction = 1`` resets them."""
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if key == "step" or not torch.is_tensor(value) or value.numel() <= 1:
                continue
            k = int(fraction * value.numel())
            if k >= value.numel():
                value.zero_()
            elif k >= 1:
                threshold = value.abs().flatten().kthvalue(k).values
                value.masked_fill_(value.abs() <= threshold, 0.0)


def _relora(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    o, steps = config.optim, config.train.steps
    every = o.relora_every or max(1, steps // 4)
    rewarmup = o.relora_rewarmup or max(1, every // 50)
    wrapped = _wrap_lora(model, config)
    optimizer = _adamw(wrapped, config, lr).optimizer

    def after_step(step: int) -> None:
        if step % every == 0 and step < steps:
            prune_moments(optimizer, merge_and_reinit_lora(wrapped), o.relora_prune)

    return MethodSetup(wrapped, optimizer, after_step=after_step, restart_every=every, rewarmup=rewarmup)


# ---------------------------------------------------------------------------------------------
# the registry

FIRA_LR = 0.01

METHODS: dict[str, Method] = {
    "adamw": Method("adamw", 1e-3, _adamw, "full-rank AdamW (torch.optim.AdamW)"),
}
for _name, _overrides in fira_optim.VARIANTS.items():
    _what = ", ".join(f"{k}={v!r}" for k, v in _overrides.items()) or "the paper's Fira"
    METHODS[_name] = Method(_name, FIRA_LR, _fira_family(_name),
                            f"fira_optim.FiraAdamW with {_what}", uses_rank=True, split_refresh=True)
METHODS.update({
    "lora": Method("lora", 1e-3, _lora, "peft LoRA on attention + MLP, the rest trained in full",
                   uses_rank=True, wraps_model=True),
    "relora": Method("relora", 1e-3, _relora,
                     "LoRA merged and restarted periodically, moments pruned, jagged LR", uses_rank=True,
                     wraps_model=True),
    "sgd": Method("sgd", 0.03, _sgd, "torch.optim.SGD with momentum betas[0]"),
    "adagrad": Method("adagrad", 1e-2, _adagrad, "torch.optim.Adagrad"),
    "adam-mini": Method("adam-mini", 1e-3, _adam_mini, "Adam-mini (the adam-mini package)"),
})
