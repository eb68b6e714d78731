"""What optimizer-state inspection counts: every tensor the state holds, also inside objects."""

from __future__ import annotations

import torch

from fira_optim import FiraAdamW, optimizer_state_numel
from fira_optim.state import optimizer_state_bytes
from tests.fira_optim.released import fira


class _Projector:
    def __init__(self) -> None:
        self.ortho_matrix = torch.zeros(4, 3)
        self.rank, self.seed = 3, 7


def test_tensors_inside_lists_dicts_and_objects_are_counted() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p] = {"step": torch.tensor(3.0), "m": torch.zeros(5), "pair": [torch.zeros(2), torch.zeros(1)],
                    "table": {"a": torch.zeros(6, dtype=torch.bfloat16)}, "projector": _Projector(), "seed": 7}
    assert optimizer_state_numel(opt) == 5 + 3 + 6 + 12
    assert optimizer_state_numel(opt, count_steps=True) == 5 + 3 + 6 + 12 + 1
    assert optimizer_state_bytes(opt) == 4 * (1 + 5 + 3 + 12) + 2 * 6


def test_the_released_firas_basis_in_its_projector_object_is_counted_as_ours_is() -> None:
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(32, 16)) for _ in range(2)]
    theirs = fira.FiraAdamW([{"params": weights[:1], "rank": 4, "update_proj_gap": 10, "alpha": 0.25,
                              "proj_type": "std"}], lr=1e-3)
    ours = FiraAdamW([{"params": weights[1:], "rank": 4, "update_proj_gap": 10}], lr=1e-3)
    for opt, w in ((theirs, weights[0]), (ours, weights[1])):
        w.grad = torch.randn(32, 16)
        opt.step()
    # two moments (32 x 4), the basis (16 x 4) and the limiter's norm; the released one keeps its
    # basis in a GradientProjector object, where it went uncounted (64 fewer)
    assert optimizer_state_numel(theirs) == optimizer_state_numel(ours) == 2 * 32 * 4 + 16 * 4 + 1
