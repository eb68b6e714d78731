"""Writes ``saved_state_0_1_0.pt``: a FiraAdamW state dict as fira-optim 0.1.0 saved it (before
the stages were rewritten as one pipeline), with the gradients and the parameters it must reach.

    PYTHONPATH=src python tests/fira_optim/data/make_saved_state.py

Run once on the old code; ``test_state_dict.py`` loads the file with today's code, continues the
run and asks for the same parameters bit for bit.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import grad_sequence, make_params  # noqa: E402

from fira_optim import FiraAdamW  # noqa: E402

SHAPES = [(12, 20), (20, 12), (10,)]
BEFORE, AFTER = 4, 3  # steps before the save (crossing the refresh at step 3), and after


def build(params):
    return FiraAdamW([{"params": params[:2], "rank": 3, "update_proj_gap": 3},
                      {"params": params[2:]}], lr=1e-2, weight_decay=0.01)


def main() -> None:
    torch.set_num_threads(1)
    params = make_params(SHAPES, seed=21)
    opt = build(params)
    grads = grad_sequence(SHAPES, BEFORE + AFTER, seed=22)
    for row in grads[:BEFORE]:
        for p, g in zip(params, row):
            p.grad = g.clone()
        opt.step()
    saved = {"params": [p.detach().clone() for p in params], "optimizer": copy.deepcopy(opt.state_dict())}
    for row in grads[BEFORE:]:
        for p, g in zip(params, row):
            p.grad = g.clone()
        opt.step()
    saved["grads"] = grads[BEFORE:]
    saved["final"] = [p.detach().clone() for p in params]
    torch.save(saved, os.path.join(os.path.dirname(__file__), "saved_state_0_1_0.pt"))


if __name__ == "__main__":
    main()
