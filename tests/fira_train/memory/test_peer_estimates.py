"""The memory estimate's rows for APOLLO, APOLLO-Mini, Flora and SlimAdam: hand-computed counts,
agreement with the tensors their optimizers really hold, and the `fira-train memory` table."""

from __future__ import annotations

import pytest
import torch

from fira_train.config.overrides import apply_overrides
from fira_train.config.recipes import micro
from fira_train.memory.estimates import (
    LLAMA_SIZES,
    PEER_METHODS,
    TABLE_METHODS,
    default_rank,
    format_memory_table,
    memory_table,
    model_footprint,
)
from fira_train.memory.matrix import footprint_numel, state_numel, vector_state_numel
from fira_train.methods.model import build_model
from fira_train.methods.registry import build_method
from fira_train.methods.slimadam import compressed_dims


def test_per_matrix_counts_by_hand() -> None:
    m, n, r = 512, 1376, 128
    assert state_numel((m, n), r, "apollo") == 2 * n * r + 2  # moments of r x max, limiter norm, seed
    assert state_numel((n, m), r, "apollo") == 2 * n * r + 2
    assert state_numel((m, n), 1, "apollo-mini") == 2 * n + 2
    assert state_numel((m, n), r, "flora") == n * r + (m + n) + 2  # momentum, Adafactor factors, RMS, seed
    assert state_numel((32000, m), r, "flora") == 32000 * m + 32000 + m + 1  # aspect > 4: full momentum
    assert state_numel((64, 64), 128, "flora") == 64 * 64 + 128 + 1  # rank above the side: full momentum
    assert state_numel((m, n), None, "slimadam") == m * n + n  # m x n first moment + the fan-in vector
    assert state_numel((m, n), None, "slimadam", compressed_dim=1) == m * n + m
    for method in PEER_METHODS:
        fp = footprint_numel((m, n), r, method)
        assert fp.weights == fp.gradients == m * n
    assert vector_state_numel(512, "flora") == 1025 and vector_state_numel(512, "slimadam") == 1024
    with pytest.raises(ValueError, match="compressed_dim"):
        state_numel((m, n), None, "slimadam", compressed_dim=2)
    with pytest.raises(ValueError, match="rank"):
        state_numel((m, n), None, "apollo")


def _tensor_numel(state: dict) -> int:
    return sum(v.numel() for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step")


@pytest.mark.parametrize("method", PEER_METHODS)
def test_estimate_counts_the_tensors_the_optimizers_hold(method: str) -> None:
    """Per matrix, the estimate = the optimizer's state tensors (+1 for the seed, an int, where
    the method projects); APOLLO-Mini's rank is 1 whatever optim.rank says."""
    config = apply_overrides(micro(), [f"optim.method={method}", "optim.rank=8"])
    setup = build_method(build_model(config.model, 96, 16, seed=0), config)
    batch = torch.arange(32).reshape(2, 16) % 96
    setup.model(input_ids=batch, labels=batch).loss.backward()
    setup.optimizer.step()
    rank = 1 if method == "apollo-mini" else 8
    for name, p in setup.model.named_parameters():
        if p.dim() != 2 or "_proj" not in name:
            continue
        dims = compressed_dims(name, p) if method == "slimadam" else None
        estimate = state_numel(tuple(p.shape), rank, method, compressed_dim=(dims or (0,))[0])
        seed = 0 if method == "slimadam" else 1
        assert _tensor_numel(setup.optimizer.state[p]) + seed == estimate, name


def test_model_footprint_of_slimadam_and_flora_by_hand() -> None:
    spec = LLAMA_SIZES["60M"]
    d, v, layers = spec.hidden, spec.vocab, spec.layers
    shapes = spec.matrix_shapes()
    slim = model_footprint("60M", "slimadam")
    assert slim.projected_states == sum(a * b + b for a, b in shapes)
    assert slim.optimizer_states == slim.projected_states + 2 * (v * d + v) + (2 * layers + 1) * 2 * d
    flora = model_footprint("60M", "flora")  # rank 128
    assert flora.projected_states == sum(128 * max(a, b) + a + b + 2 for a, b in shapes)
    assert flora.optimizer_states == flora.projected_states + 2 * (v * d + v + d + 1) + (2 * layers + 1) * (2 * d + 1)
    apollo = model_footprint("60M", "apollo")
    assert apollo.optimizer_states - apollo.projected_states == 2 * spec.unprojected_numel  # AdamW on the rest
    assert slim.weights == flora.weights == apollo.weights == spec.numel


def test_memory_table_has_a_row_per_peer_with_its_rank() -> None:
    rows = {(r["size"], r["method"]): r for r in memory_table()}
    assert {m for _, m in rows} == set(TABLE_METHODS) | set(PEER_METHODS)
    assert [rows[(s, "apollo")]["rank"] for s in LLAMA_SIZES] == [128, 256, 256, 512, 256]
    assert {rows[(s, "apollo-mini")]["rank"] for s in LLAMA_SIZES} == {1}
    assert [rows[(s, "flora")]["rank"] for s in LLAMA_SIZES] == [128, 256, 256, 512, 64]
    assert {rows[(s, "slimadam")]["rank"] for s in LLAMA_SIZES} == {None}
    assert default_rank("7B", "apollo") == 256 and default_rank("1B", "slimadam") is None
    for size in LLAMA_SIZES:
        states = {m: rows[(size, m)]["optimizer_states"] for m in ("full", "fira", "apollo", "apollo-mini",
                                                                   "flora", "slimadam")}
        # every peer holds less than Adam; APOLLO-Mini (rank 1) less than APOLLO; SlimAdam ~half of Adam
        assert max(states[m] for m in PEER_METHODS) < states["full"]
        assert states["apollo-mini"] < states["apollo"]
        assert states["slimadam"] == pytest.approx(states["full"] / 2, rel=0.01)
        assert rows[(size, "slimadam")]["paper_G"] is None
    text = format_memory_table(memory_table(sizes=["60M"]))
    for label in ("| 60M | APOLLO | 128 |", "| 60M | APOLLO-Mini | 1 |", "| 60M | Flora | 128 |", "| 60M | SlimAdam |  |"):
        assert label in text
