"""Callbacks' state: kept in one-process checkpoints, loaded on resume, refused where it cannot be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fira_train.run import checkpoint as ckpt
from fira_train.run.callbacks import TrainCallback, callback_states, load_callback_states
from fira_train.run.train import train
from tests.fira_train.harness_fixtures import StopRun, micro_config, stop_at_checkpoint  # noqa: F401


class Counter(TrainCallback):
    """Counts the steps it saw (its state) and records where each sitting began."""

    def __init__(self) -> None:
        self.seen = torch.zeros((), dtype=torch.int64)
        self.began: list[int] = []
        self.steps: list[int] = []

    def begin(self, step: int) -> None:
        self.began.append(step)

    def after_step(self, step, model, optimizer, loss) -> None:
        self.seen += 1
        self.steps.append(step)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"].clone()


def test_a_resumed_run_continues_its_callbacks_from_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    common = ["optim.method=fira", "train.steps=8", "train.save_every=3", "train.eval_every=0"]
    # stopped before saving step 6: steps 4-5 ran after the newest checkpoint (3), their count is not in it
    go_on = stop_at_checkpoint(monkeypatch, 6, saved=False)
    first = Counter()
    with pytest.raises(StopRun):
        train(micro_config(tmp_path, *common), callbacks=[first])
    assert int(first.seen) == 6 and first.began == [0]
    go_on()

    second = Counter()
    train(micro_config(tmp_path, *common), resume="latest", callbacks=[second])
    assert second.began == [3] and second.steps == [4, 5, 6, 7, 8]
    assert int(second.seen) == 8  # 3 from the checkpoint + 5 now: as a run that never stopped
    saved = torch.load(ckpt.complete_checkpoints(tmp_path / "run")[-1][1] / ckpt.STATE_FILE, weights_only=True)
    assert saved["callbacks"] == [{"seen": torch.tensor(8)}]


def test_stateless_callbacks_resume_from_a_checkpoint_without_callback_state() -> None:
    load_callback_states([TrainCallback()], None)  # a checkpoint of an older version
    load_callback_states([], [])
    load_callback_states([], [{}, {}])  # an analysis's run (stateless callbacks) continued by pretrain
    with pytest.raises(ValueError, match="state of 1 callbacks, the run has 0"):
        load_callback_states([], [{"seen": torch.tensor(3)}])
    assert callback_states([TrainCallback(), Counter()]) == [{}, {"seen": torch.tensor(0)}]


def test_mismatched_callback_state_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"no state of the run's callbacks \(Counter\)"):
        load_callback_states([TrainCallback(), Counter()], None)
    with pytest.raises(ValueError, match="state of 1 callbacks, the run has 2"):
        load_callback_states([TrainCallback(), Counter()], [{}])
    with pytest.raises(ValueError, match=r"TrainCallback keeps no state.*\['seen'\]"):
        load_callback_states([TrainCallback()], [{"seen": torch.tensor(3)}])


def test_stateful_callbacks_are_refused_in_a_distributed_run(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "train.parallel=ddp")
    with pytest.raises(ValueError, match=r"\(Counter\) run in one process only.*train.parallel='ddp'"):
        train(config, callbacks=[TrainCallback(), Counter()])
    assert not (tmp_path / "run").exists()  # refused before anything is written
