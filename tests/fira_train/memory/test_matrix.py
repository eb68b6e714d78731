"""Per-matrix memory formulas (paper Table "Comparison of different methods")."""

from __future__ import annotations

import pytest
import torch

from fira_optim import FiraAdamW, GaLoreAdamW, optimizer_state_numel
from fira_train.memory.matrix import (
    MatrixFootprint,
    footprint_numel,
    is_projected,
    llama_matrix_shapes,
    state_numel,
    total_state_numel,
)


# Hand-computed for m = 3 < n = 5, r = 2: basis 3*2 = 6, moments 2 * 2*5 = 20.
@pytest.mark.parametrize(
    ("shape", "rank", "method", "expected"),
    [
        ((3, 5), 2, "galore", 26),
        ((5, 3), 2, "galore", 26),  # the basis always sits on the smaller side
        ((3, 5), 2, "fira", 27),  # + the limiter's previous norm
        ((5, 3), 2, "fira", 27),
        ((3, 5), 2, "lora", 32),  # B (3x2) and A (2x5), two moments each
        ((3, 5), None, "adam", 30),
        ((3, 5), 7, "full", 30),  # rank ignored
        ((3, 5), 3, "fira", 30),  # rank >= min(m, n): plain Adam, no limiter scalar
        ((3, 5), 4, "galore", 30),
        ((4, 4), 1, "fira", 4 + 8 + 1),
        ((512, 1376), 128, "fira", 128 * 512 + 2 * 128 * 1376 + 1),
    ],
)
def test_state_numel_hand_computed(shape, rank, method, expected):
    assert state_numel(shape, rank, method) == expected


def test_footprint_rows_of_the_paper_table():
    m, n, r = 3, 5, 2
    assert footprint_numel((m, n), r, "fira") == MatrixFootprint(m * n, m * n, m * r + 2 * n * r + 1)
    assert footprint_numel((m, n), r, "galore") == MatrixFootprint(m * n, m * n, m * r + 2 * n * r)
    lora = footprint_numel((m, n), r, "lora")
    assert lora == MatrixFootprint(m * n + m * r + n * r, m * r + n * r, 2 * m * r + 2 * n * r)
    assert lora.total == 15 + 16 + 16 + 32
    assert footprint_numel((m, n), None, "adam") == MatrixFootprint(15, 15, 30)


def test_lora_keeps_adapters_at_any_rank():
    # LoRA adds B, A whatever the rank: no fallback to Adam.
    assert state_numel((3, 5), 10, "lora") == 2 * (3 + 5) * 10


def test_is_projected_and_total():
    assert is_projected((8, 16), 7) and not is_projected((8, 16), 8)
    shapes = [(3, 5), (5, 3), (4, 4)]
    assert total_state_numel(shapes, 2, "galore") == 26 + 26 + (8 + 16)


def test_llama_matrix_shapes_order_and_count():
    shapes = llama_matrix_shapes(hidden=4, intermediate=6, layers=2)
    layer = [(4, 4), (4, 4), (4, 4), (4, 4), (6, 4), (6, 4), (4, 6)]
    assert shapes == layer * 2


def test_llama_matrix_shapes_are_linear_weight_shapes():
    hidden, inter = 8, 12
    q, gate, down = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, inter), torch.nn.Linear(inter, hidden)
    shapes = llama_matrix_shapes(hidden, inter, 1)
    assert shapes[0] == tuple(q.weight.shape)
    assert shapes[4] == tuple(gate.weight.shape)
    assert shapes[6] == tuple(down.weight.shape)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"shape": (3,), "rank": 2, "method": "fira"}, "shape"),
        ({"shape": (0, 5), "rank": 2, "method": "fira"}, "shape"),
        ({"shape": (3.0, 5), "rank": 2, "method": "fira"}, "shape"),
        ({"shape": (3, 5), "rank": 0, "method": "fira"}, "rank"),
        ({"shape": (3, 5), "rank": None, "method": "galore"}, "rank"),
        ({"shape": (3, 5), "rank": True, "method": "lora"}, "rank"),
        ({"shape": (3, 5), "rank": 2, "method": "sgd"}, "method"),
    ],
)
def test_bad_input_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        state_numel(**kwargs)


def test_llama_matrix_shapes_rejects_bad_sizes():
    with pytest.raises(ValueError, match="layers=0"):
        llama_matrix_shapes(4, 6, 0)


@pytest.mark.parametrize(("cls", "method"), [(FiraAdamW, "fira"), (GaLoreAdamW, "galore")])
def test_optimizer_holds_exactly_the_formula(cls, method):
    """The optimizer's state after a step is the paper's formula: no hidden full-size buffers."""
    torch.manual_seed(0)
    cases = [((6, 10), 2), ((10, 6), 2), ((8, 8), 3), ((5, 7), 5), ((5, 7), 9)]
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape, _ in cases]
    groups = [{"params": [p], "rank": r} for p, (_, r) in zip(params, cases)]
    opt = cls(groups, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert optimizer_state_numel(opt) == sum(state_numel(s, r, method) for s, r in cases)
