"""Writes ``saved_state_int8.pt``: a FiraAdamW state dict with ``state_dtype="int8"`` as the
torchao-kernel code saved it (uint8 codes + fp32 block scales), with the fp32 moments that code
decoded them to.

    PYTHONPATH=src python tests/fira_optim/data/make_saved_int8_state.py

Run once on the old code; ``test_precision.py`` loads the file with today's code and asks for the
same decoded moments bit for bit (the codes keep their meaning whatever kernel encodes them).
The parameters are not saved: loading a state dict does not depend on their values.
"""

from __future__ import annotations

import copy
import os

import torch

from fira_optim import FiraAdamW
from fira_optim.precision import decode

SHAPES = [(64, 256), (64, 128)]  # R of the first is 16 x 256; the second is a plain matrix
KEYS = ("exp_avg", "exp_avg_sq")


def build(params):
    return FiraAdamW([{"params": params[:1], "rank": 16, "update_proj_gap": 3},
                      {"params": params[1:]}], lr=1e-2, state_dtype="int8")


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(31)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in SHAPES]
    opt = build(params)
    for step in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * (1 + step)
        opt.step()
    state = opt.state_dict()
    decoded = [{k: v for k, v in decode(s, KEYS, torch.float32).items() if k in KEYS}
               for s in (opt.state[p] for p in params)]
    saved = {"optimizer": copy.deepcopy(state), "decoded": decoded}
    torch.save(saved, os.path.join(os.path.dirname(__file__), "saved_state_int8.pt"))


if __name__ == "__main__":
    main()
