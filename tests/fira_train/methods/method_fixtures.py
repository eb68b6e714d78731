"""What the method tests share: a micro config of a method, its model, a learnable batch, one
training step."""

from __future__ import annotations

import torch
from torch import nn

from fira_train.config.overrides import apply_overrides
from fira_train.config.recipes import micro
from fira_train.methods.model import build_model

VOCAB, SEQ = 96, 16


def method_config(method: str, *overrides: str):
    """``micro`` with ``method`` at rank 8 and T = 2 (refreshes within a few steps)."""
    return apply_overrides(micro(), [f"optim.method={method}", "optim.rank=8", "optim.update_proj_gap=2",
                                     *overrides])


def method_model(config) -> nn.Module:
    return build_model(config.model, VOCAB, SEQ, seed=0)


def learnable_batch(seed: int = 0) -> torch.Tensor:
    """Four sequences, each counting upwards from a random start: a pattern a step can learn."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (4, 1), generator=g)
    return (start + torch.arange(SEQ)) % VOCAB


def train_step(setup, batch: torch.Tensor) -> float:
    loss = setup.model(input_ids=batch, labels=batch).loss
    loss.backward()
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return loss.item()
