"""A tiny language model and a deterministic global batch stream for the parallelism tests.

Weights: up (9 x 6, right projection), down (6 x 9, left), head (11 x 6, right): 9 and 11 rows
do not divide by 2, so FSDP2 shards them unevenly.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HIDDEN, LAYERS = 11, 6, 9, 2
GLOBAL_BATCH, SEQ = 4, 7


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(dtype: torch.dtype = torch.float64) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().to(dtype)


def global_batch(step: int) -> torch.Tensor:
    """The same (GLOBAL_BATCH, SEQ) token batch for a step at every world size."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (gathered from FSDP2 shards), keyed without DDP's prefix."""
    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = value.detach().clone()
    return out


def make_optimizer(model: nn.Module, kind: str, **options):
    """``"fira"`` (rank 2, T = 2: refreshes at steps 0, 2, 4, ...) or ``"adamw"``."""
    import fira_optim
    from fira_train.run.parallel import unwrap

    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    groups = fira_optim.param_groups(unwrap(model), rank=2, update_proj_gap=2, alpha=0.5)
    return fira_optim.FiraAdamW(groups, lr=0.02, weight_decay=0.1, **options)


def train_worker(rank: int, world: int, mode: str, steps: int, kind: str = "fira",
                 options: dict | None = None, run_dir: str | None = None,
                 save_at: int | None = None, load_from: str | None = None, idle_until: int = 0) -> dict:
    """Train the tiny LM under ``mode`` ("none", "ddp", "fsdp2") for global steps up to
    ``steps``, optionally saving a checkpoint after ``save_at`` steps or starting from one.
    ``blocks.1.up`` has no gradient before step ``idle_until`` (a layer not used so far).
    Returns the global mean loss of each step run and the full parameters at the end."""
    from fira_train.run.dist_checkpoint import load_checkpoint, save_checkpoint
    from fira_train.run.parallel import all_reduce_mean, current_env, parallelize, shard_batch, unwrap

    env = current_env()
    model = parallelize(build_model(), mode, env)
    optimizer = make_optimizer(model, kind, **(options or {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    start = 0
    if load_from is not None:
        extra = load_checkpoint(load_from, model, optimizer, scheduler)
        start = extra["step"]
    losses, draws = {}, {}
    for step in range(start, steps):
        # What dropout or data shuffling would draw: must continue identically after a resume.
        draws[step] = (float(torch.rand(())), random.random(), float(np.random.rand()))
        loss = loss_fn(model, shard_batch(global_batch(step), env))
        loss.backward()
        if step < idle_until:
            for p in unwrap(model).blocks[1].up.parameters():
                p.grad = None
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step] = all_reduce_mean(loss, env)
        if save_at is not None and step + 1 == save_at:
            save_checkpoint(run_dir, save_at, model, optimizer, scheduler,
                            {"step": save_at, "data": {"index": save_at}})
    return {"losses": losses, "draws": draws, "params": full_parameters(model),
            "lr": scheduler.get_last_lr()}
