"""Scaling-factor similarity: the recorded factors are the ones the optimizers apply."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import fira_optim
from fira_train.analysis.similarity import (
    FACTORS_FILE,
    ScalingFactorRecorder,
    projected_matrices,
    run_similarity,
    sampled_columns,
    scaling_factors,
    similarity,
)
from fira_train.run.metrics import read_jsonl
from tests.fira_train.analysis.analysis_fixtures import analysis_config, corpus_root  # noqa: F401

LR, ALPHA = 0.01, 0.25


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 12))


def _steps(model, optimizer, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` steps on random data; the weights before the last step, and its gradients."""
    x, y = torch.randn(64, 24), torch.randn(64, 12)
    for _ in range(n):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x + 0.1 * torch.randn_like(x)), y).backward()
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
    return before


@pytest.mark.parametrize("level", ["matrix", "column"])
def test_fira_factors_equal_the_factors_fira_applies(level: str) -> None:
    # With only_scaling and no limiter Fira's update is alpha * phi * G, so phi can be read off
    # the weight change and must equal what the recorder computes from the optimizer state.
    model = _model()
    optimizer = fira_optim.FiraAdamW(fira_optim.param_groups(model, rank=5, alpha=ALPHA), lr=LR,
                                     only_scaling=True, limiter="none", scaling=level)
    before = _steps(model, optimizer, 3)
    group = optimizer.param_groups[0] if optimizer.param_groups[0]["rank"] else optimizer.param_groups[1]
    for name, p in projected_matrices(model).items():
        matrix, column, side = scaling_factors(name, p, optimizer.state[p], group)
        applied = (before[name] - p.detach()) / (LR * ALPHA)
        dim = fira_optim.projection.reduce_dim(side)
        if level == "matrix":
            assert matrix == pytest.approx(float(applied.norm() / p.grad.norm()), rel=1e-4)
        else:
            expected = torch.linalg.vector_norm(applied, dim=dim) / torch.linalg.vector_norm(p.grad, dim=dim)
            torch.testing.assert_close(column, expected, rtol=1e-4, atol=0)


def test_adam_factors_equal_the_factors_adam_applies() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    before = _steps(model, optimizer, 3)
    for name, p in projected_matrices(model).items():
        matrix, column, side = scaling_factors(name, p, optimizer.state[p], optimizer.param_groups[0])
        applied = (before[name] - p.detach()) / LR  # psi(G)
        assert matrix == pytest.approx(float(applied.norm() / p.grad.norm()), rel=1e-4)
        dim = fira_optim.projection.reduce_dim(side)
        torch.testing.assert_close(column, torch.linalg.vector_norm(applied, dim=dim)
                                   / torch.linalg.vector_norm(p.grad, dim=dim), rtol=1e-4, atol=0)


def test_similarity_metrics() -> None:
    x = np.array([1.0, 3.0, 2.0, 5.0, 4.0])
    same = similarity(x, 2 * x)
    assert same["cosine"] == pytest.approx(1.0)
    assert same["spearman"] == pytest.approx(1.0) and same["kendall"] == pytest.approx(1.0)
    assert same["pearson"] == pytest.approx(1.0) and same["pearson_p"] < 0.01
    assert same["rel_mse"] == pytest.approx(0.25)
    assert same["mse"] == pytest.approx(np.mean(x ** 2)) and same["distance"] == pytest.approx(np.linalg.norm(x))
    reverse = similarity(x, x[::-1].copy())
    assert reverse["spearman"] == pytest.approx(-0.3)  # ranks 1 3 2 5 4 vs 4 5 2 3 1
    with pytest.raises(ValueError, match="same length"):
        similarity(x, x[:3])


def test_sampled_columns_are_fixed_by_name_and_seed() -> None:
    a = sampled_columns("layers.0.q_proj.weight", 256, 100, seed=0)
    assert len(a) == 100 == len(set(a)) and a == sorted(a) and max(a) < 256
    assert a == sampled_columns("layers.0.q_proj.weight", 256, 100, seed=0)
    assert a != sampled_columns("layers.0.k_proj.weight", 256, 100, seed=0)
    assert a != sampled_columns("layers.0.q_proj.weight", 256, 100, seed=1)
    assert sampled_columns("x", 64, 100, seed=0) == list(range(64))
    with pytest.raises(ValueError, match="every"):
        ScalingFactorRecorder("unused.jsonl", every=0)


def test_similarity_analysis_end_to_end(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=4")
    out = tmp_path / "similarity"
    result = run_similarity(config, out, ranks=(8, 32), every=2, columns=10)
    full = read_jsonl(out / "adamw" / FACTORS_FILE)
    low = read_jsonl(out / "fira-r8" / FACTORS_FILE)
    assert [r["step"] for r in full] == [r["step"] for r in low] == [1, 2, 4]
    assert len(full[0]["matrix"]) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert all(len(v) == 10 for v in full[0]["column"].values())
    # same initialisation and first batch: at step 1 Adam's psi is ~sign(G), so the full-rank
    # matrix factor is sqrt(numel) / ||G|| -- and differs from the rank-8 one
    assert full[0]["matrix"] != low[0]["matrix"]
    for rank in (8, 32):
        for level in ("matrix", "column"):
            avg = result["averages"][rank][level]
            assert avg["steps"] == 3 and 0 < avg["cosine"] <= 1 and -1 <= avg["spearman"] <= 1
            assert 0 <= avg["spearman_p"] <= 1
    text = result["report"].read_text()
    assert "r/d_model = 8/64" in text and "0.9922" in text and "Kendall" in text
    assert result["figure"].read_bytes()[:4] == b"\x89PNG"
