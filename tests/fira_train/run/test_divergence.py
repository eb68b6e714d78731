"""When a run has diverged (fira_train.run.divergence); its errors cross process boundaries."""

from __future__ import annotations

import pickle

import pytest

from fira_train.run import train as train_module
from fira_train.run.divergence import DIVERGENCE_LOSS, DivergedError, check_loss, diverged


def test_divergence_rule() -> None:
    assert not diverged(0.0) and not diverged(DIVERGENCE_LOSS) and diverged(DIVERGENCE_LOSS * 1.01)
    assert diverged(float("nan")) and diverged(float("inf"))
    with pytest.raises(DivergedError, match="step 7: training loss 3e\\+06"):
        check_loss(7, 3e6)
    # analysis workers send their errors to the parent process: they must unpickle
    for err in (DivergedError(3, 150.0, "validation loss"), train_module.NonFiniteLossError(2, float("nan"))):
        copy = pickle.loads(pickle.dumps(err))
        assert type(copy) is type(err) and str(copy) == str(err)
        # a resume refuses a lowered optim.lr or a grad_clip: the way on is to start over
        # (each command then says how it trains a run again: user_errors)
        assert "train the run again" in str(err) and "--resume-step" not in str(err) and "resume from" not in str(err)
