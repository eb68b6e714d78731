"""What a registry entry is (:class:`Method`) and what its factory builds (:class:`MethodSetup`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only: the config validates method names against the registry
    from fira_train.config.run_config import RunConfig


@dataclass
class MethodSetup:
    """What a method factory returns to the training loop."""

    model: nn.Module
    """The model to train (the input model, or a ``peft`` wrapper of it)."""
    optimizer: torch.optim.Optimizer
    """The optimizer over the model's trainable parameters."""
    after_step: Callable[[int], None] | None = None
    """Called with the number of updates applied after each one (ReLoRA's restarts): the
    schedule's count, which a step skipped for an fp16 overflow does not advance."""
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
    uses: frozenset[str] = frozenset()
    """The ``optim`` settings ``build`` reads beside ``method`` and ``lr`` (``"rank"``,
    ``"betas"``, ...): a run of this method is the same whatever the others say
    (``fira-train`` warns when one is given to methods none of which uses it)."""
    wraps_model: bool = False
    """Whether ``build`` returns a wrapper of the model (``peft`` adapters) rather than the model."""
    split_refresh: bool = False
    """Whether ``build`` accepts ``split_refresh=`` (``fira_optim.FiraAdamW``'s option that deals
    the refresh SVDs to the ranks of a DDP run)."""
    fsdp2: bool = True
    """Whether the method runs under ``train.parallel="fsdp2"`` (its optimizer steps sharded
    DTensor parameters); the config refuses the combination otherwise."""

    def reads(self, key: str) -> bool:
        """Whether a run of this method reads the config key ``key`` (``section.field``): every key
        outside ``optim``, ``optim.method``, ``optim.lr`` and the ``optim`` settings it :attr:`uses`.
        One it does not read cannot change the run: two specs that differ only there are the same
        run, and a run made with another value of it is reused and resumed as it stands."""
        section, _, name = key.partition(".")
        return section != "optim" or name in ("method", "lr") or name in self.uses

    @property
    def uses_rank(self) -> bool:
        """Whether ``optim.rank`` matters (the projection's or the adapters' rank)."""
        return "rank" in self.uses
