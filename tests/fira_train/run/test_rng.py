"""The generators' states in both checkpoint layouts: restoring one replays the same draws."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fira_train.run.rng import rank_rng_state, rng_state, seed_everything, set_rank_rng_state, set_rng_state


def _draws() -> tuple:
    return random.random(), np.random.rand(), torch.rand(3).tolist()


@pytest.mark.parametrize(("capture", "restore"), [(rng_state, set_rng_state),
                                                  (rank_rng_state, set_rank_rng_state)])
def test_a_restored_state_replays_the_same_draws(capture, restore) -> None:
    seed_everything(3)
    _draws()
    state = capture()
    expected = _draws()
    seed_everything(4)  # move every generator elsewhere
    restore(state)
    assert _draws() == expected


def test_the_rank_layout_holds_plain_lists_and_tensors() -> None:
    state = rank_rng_state()
    assert isinstance(state["python"], list) and isinstance(state["python"][1], list)
    keys, pos, has_gauss, cached = state["numpy"]
    assert keys.dtype == torch.int64 and isinstance(pos, int) and isinstance(cached, float)
    assert isinstance(has_gauss, int)
