"""LoRA and ReLoRA for pre-training: ``peft`` adapters on the attention and MLP matrices, and
ReLoRA's restarts (merge, re-initialise, prune the moments)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from fira_train.methods.method import MethodSetup
from fira_train.methods.optimizers import build_adamw

if TYPE_CHECKING:  # annotations only: the config validates method names against the registry
    from fira_train.config.run_config import RunConfig

#: The LLaMA linear layers that LoRA adapts and Fira/GaLore project.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def wrap_lora(model: nn.Module, config: "RunConfig") -> nn.Module:
    """``model`` with ``peft`` LoRA adapters of rank ``optim.rank`` on :data:`LORA_TARGETS`; the
    rest of the model trains in full."""
    from fira_train.methods.packages import quiet_import_logs

    with quiet_import_logs():  # peft imports bitsandbytes, whose 4-bit kernels LoRA does not use
        from peft import LoraConfig, get_peft_model  # only the LoRA methods need peft: seconds to import

    o = config.optim
    lora = LoraConfig(r=o.rank, lora_alpha=o.lora_alpha, lora_dropout=o.lora_dropout,
                      target_modules=list(LORA_TARGETS), bias="none")
    with warnings.catch_warnings():
        # peft (0.21.2 and before) reads the model's is_gradient_checkpointing, which transformers
        # deprecated for is_activation_checkpointing: a warning of their code the user can do nothing about
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        wrapped = get_peft_model(model, lora)
    # peft freezes every base weight; in pre-training only the adapted matrices stay frozen.
    for name, p in wrapped.named_parameters():
        if "lora_" not in name and not name.endswith("base_layer.weight"):
            p.requires_grad_(True)
    return wrapped


def build_lora(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """LoRA adapters trained with AdamW."""
    wrapped = wrap_lora(model, config)
    return MethodSetup(wrapped, build_adamw(wrapped, config, lr).optimizer)


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


def default_rewarmup(every: int) -> int:
    """ReLoRA's re-warm-up for cycles of ``every`` steps: 2% of a cycle (its 100 steps per 5000),
    but at least 10 steps, or a quarter of a cycle where that is less. Right after a restart the
    moments are pruned, so Adam's first steps are many times their usual size; on short cycles
    2% is a single step, which ramps nothing (``tiny``'s cycles are 75 steps)."""
    return max(1, every // 50, min(10, every // 4))


def legacy_rewarmup(every: int) -> int:
    """The re-warm-up the versions before :func:`default_rewarmup` gave cycles of ``every``
    steps: 2% of a cycle, at least 1 (runs that recorded no re-warm-up ran it)."""
    return max(1, every // 50)


def relora_schedule(config: "RunConfig") -> tuple[int, int]:
    """``(relora_every, relora_rewarmup)`` as a run trains them: the settings, or where None a
    quarter of the run and :func:`default_rewarmup` (a run records these numbers)."""
    every = config.optim.relora_every or max(1, config.train.steps // 4)
    return every, config.optim.relora_rewarmup or default_rewarmup(every)


def build_relora(model: nn.Module, config: "RunConfig", lr: float) -> MethodSetup:
    """ReLoRA: LoRA merged and restarted every ``optim.relora_every`` steps, moments pruned, LR re-warmed."""
    o, steps = config.optim, config.train.steps
    every, rewarmup = relora_schedule(config)
    wrapped = wrap_lora(model, config)
    optimizer = build_adamw(wrapped, config, lr).optimizer

    def after_step(step: int) -> None:
        if step % every == 0 and step < steps:
            prune_moments(optimizer, merge_and_reinit_lora(wrapped), o.relora_prune)

    return MethodSetup(wrapped, optimizer, after_step=after_step, restart_every=every, rewarmup=rewarmup)
