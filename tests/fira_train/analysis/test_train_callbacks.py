"""The ``callbacks`` hook of fira_train.run.train.train: when callbacks run and what they see."""

from __future__ import annotations

from pathlib import Path

import torch

from fira_train.run.callbacks import TrainCallback
from fira_train.run.train import train
from tests.fira_train.analysis.analysis_fixtures import analysis_config, corpus_root  # noqa: F401


class Probe(TrainCallback):
    """Records what each hook sees; optionally zeroes every gradient before the step."""

    def __init__(self, zero: bool = False) -> None:
        self.zero = zero
        self.events: list[tuple[str, int, bool, float]] = []

    def _see(self, event: str, step: int, model: torch.nn.Module, optimizer, loss: float) -> None:
        has_grads = all(p.grad is not None for p in model.parameters() if p.requires_grad)
        weights = float(sum(p.detach().double().sum() for p in model.parameters()))
        self.events.append((event, step, has_grads, weights))
        assert loss > 0 and len(optimizer.param_groups) >= 1

    def before_step(self, step, model, optimizer, loss):
        self._see("before", step, model, optimizer, loss)
        if self.zero:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()

    def after_step(self, step, model, optimizer, loss):
        self._see("after", step, model, optimizer, loss)


def test_callbacks_run_around_every_step_with_gradients_present(tmp_path: Path, corpus_root: Path) -> None:
    probe = Probe()
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=3", "optim.method=adamw")
    train(config, callbacks=[probe])
    assert [(e, s) for e, s, _, _ in probe.events] == [
        ("before", 1), ("after", 1), ("before", 2), ("after", 2), ("before", 3), ("after", 3)]
    assert all(has for _, _, has, _ in probe.events)
    # the optimizer step happens between the two hooks: the weights change there
    assert probe.events[0][3] != probe.events[1][3]


def test_a_callback_can_change_the_gradients_the_optimizer_uses(tmp_path: Path, corpus_root: Path) -> None:
    probe = Probe(zero=True)
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=3", "optim.method=adamw")
    train(config, callbacks=[probe])
    # AdamW without weight decay does not move on all-zero gradients
    assert len({w for _, _, _, w in probe.events}) == 1
