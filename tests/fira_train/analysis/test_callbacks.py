"""Analysis callbacks: gradient noise, group options, norm recording."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import fira_optim
from fira_optim import projection, subspace
from fira_train.analysis.callbacks import (
    GradientNoise,
    GroupOptions,
    NormRecorder,
    global_grad_norm,
    residual_norm,
)
from fira_train.files import read_json_lines


def _model_with_grads(value: float = 0.0) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.Linear(24, 16))
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    return model


def test_gradient_noise_has_the_requested_scale_and_is_reproducible() -> None:
    a, b = _model_with_grads(), _model_with_grads()
    GradientNoise(1e-3, seed=7).before_step(1, a, None, 1.0)
    GradientNoise(1e-3, seed=7).before_step(1, b, None, 1.0)
    noise = torch.cat([p.grad.flatten() for p in a.parameters()])
    assert noise.std().item() == pytest.approx(1e-3, rel=0.1)
    assert abs(noise.mean().item()) < 2e-4
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    c = _model_with_grads()
    GradientNoise(1e-3, seed=8).before_step(1, c, None, 1.0)
    assert not torch.equal(next(c.parameters()).grad, next(a.parameters()).grad)
    # not the stream the model's initialisation draws from the same seed
    init = torch.Generator().manual_seed(7)  # the stream torch.manual_seed(7) gives the model's init
    initial = torch.cat([torch.randn(p.shape, generator=init).flatten() for p in a.parameters()])
    assert not torch.allclose(noise / 1e-3, initial, rtol=1e-3, atol=1e-5)
    # scale 0 leaves the gradients alone
    first = next(a.parameters()).grad.clone()
    GradientNoise(0.0).before_step(1, a, None, 1.0)
    assert torch.equal(next(a.parameters()).grad, first)


@pytest.mark.parametrize("scale", [-1.0, math.nan, math.inf, "1e-5"])
def test_gradient_noise_rejects_bad_scales(scale) -> None:
    with pytest.raises(ValueError, match="scale"):
        GradientNoise(scale)


def test_group_options_set_projected_groups_only() -> None:
    model = _model_with_grads(0.1)
    optimizer = fira_optim.FiraAdamW(fira_optim.param_groups(model, rank=4) + [], lr=0.01)
    GroupOptions(gamma=1.1).before_step(1, model, optimizer, 1.0)
    assert [g["gamma"] for g in optimizer.param_groups if g["rank"] is not None] == [1.1]
    plain = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="no projected param group"):
        GroupOptions(gamma=1.1).before_step(1, model, plain, 1.0)
    with pytest.raises(ValueError, match="no option 'gama'"):
        GroupOptions(gama=1.1).before_step(1, model, optimizer, 1.0)


def test_norms_match_their_definitions(tmp_path: Path) -> None:
    model = _model_with_grads(0.5)
    expected = math.sqrt(sum(p.numel() for p in model.parameters())) * 0.5
    assert global_grad_norm(model) == pytest.approx(expected)
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer = fira_optim.FiraAdamW(fira_optim.param_groups(model, rank=4), lr=0.01, limiter="none")
    assert residual_norm(optimizer) is None  # no state yet
    recorder = NormRecorder(tmp_path / "norms.jsonl")
    recorder.before_step(1, model, optimizer, 2.0)
    optimizer.step()
    recorder.after_step(1, model, optimizer, 2.0)
    (record,) = read_json_lines(tmp_path / "norms.jsonl")
    # ||S|| with phi from Fira's state, recomputed from the definitions
    squares = 0.0
    for p in model.parameters():
        state = optimizer.state[p]
        if "basis" not in state:
            continue
        side = projection.projection_side(tuple(p.shape), "std")
        low = projection.project(p.grad, state["basis"], side)
        dim = projection.reduce_dim(side)
        n = (state["exp_avg"] / (state["exp_avg_sq"].sqrt() + 1e-8)) * subspace.adam_bias_correction(1, 0.9, 0.999)
        phi = (torch.linalg.vector_norm(n, dim=dim, keepdim=True)
               / (torch.linalg.vector_norm(low, dim=dim, keepdim=True) + 1e-8))
        residual = p.grad - projection.project_back(low, state["basis"], side)
        squares += float(torch.linalg.vector_norm(phi * residual)) ** 2
    assert record["residual_norm"] == pytest.approx(math.sqrt(squares), rel=1e-4)
    assert record["grad_norm"] > 0 and record["loss"] == 2.0 and record["step"] == 1
