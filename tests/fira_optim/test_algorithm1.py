"""The optimizer's reference path against a float64 transcription of Algorithm 1."""

import warnings

import pytest
import torch

from fira_optim import FiraAdamW
from fira_optim.projection import projection_side

from .algorithm1 import Algorithm1

SHAPES = [(24, 40), (40, 24), (32, 32)]  # wide (left), tall (right), square (right by the tie rule)


def _grads(shape, steps, seed):
    g = torch.Generator().manual_seed(seed)
    # Low-rank structure plus noise, so that the top singular vectors are well separated.
    a = torch.randn(shape[0], 3, generator=g, dtype=torch.float64)
    b = torch.randn(3, shape[1], generator=g, dtype=torch.float64)
    return [a @ b * (1 + 0.1 * k) + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
            for k in range(steps)]


def _follow(w, opt, ref, grads):
    """Step ``opt`` (over ``w``) and the transcription ``ref`` on the same gradients: equal weights
    after every step."""
    for k, g in enumerate(grads):
        w.grad = g.clone()
        opt.step()
        expected = ref.step(g)
        torch.testing.assert_close(w.detach(), expected, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"step {k}: {m}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("implementation", ["reference", "fast"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("align_signs", [True, False])
def test_matches_algorithm1_float64(shape, implementation, weight_decay, align_signs):
    steps, T, rank = 23, 5, 4  # crosses four projection refreshes
    w0 = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.nn.Parameter(w0.clone())
    opt = FiraAdamW([{"params": [w], "rank": rank}], lr=0.01, update_proj_gap=T, alpha=0.25,
                    weight_decay=weight_decay, implementation=implementation,
                    align_signs=align_signs)
    side = projection_side(shape, "std")
    ref = Algorithm1(w0, lr=0.01, rank=rank, T=T, alpha=0.25, weight_decay=weight_decay,
                     transpose=(side == "right"), align_signs=align_signs)
    _follow(w, opt, ref, _grads(shape, steps, seed=2))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("implementation", ["reference", "fast"])
@pytest.mark.parametrize("rank", [4, 24, 64])
def test_fira_only_scaling_matches_its_transcription_at_every_rank(shape, implementation, rank):
    """Fira-only-scaling, W -= lr * phi(R) G: at a rank below min(m, n), and at min(m, n) and
    above, where it still projects (on all min(m, n) directions) rather than train the matrix
    with plain Adam: the paper's rank ablation runs it at full rank, and finds it is not Adam."""
    steps, T = 13, 5
    w0 = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.nn.Parameter(w0.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the "none is projected" warning of full-rank groups: not here
        opt = FiraAdamW([{"params": [w], "rank": rank}], lr=0.01, update_proj_gap=T, alpha=0.25,
                        only_scaling=True, implementation=implementation)
    side = projection_side(shape, "std")
    ref = Algorithm1(w0, lr=0.01, rank=min(rank, *shape), T=T, alpha=0.25, transpose=(side == "right"),
                     only_scaling=True)
    adam = torch.optim.AdamW([w0.clone().requires_grad_()], lr=0.01, weight_decay=0.0)
    grads = _grads(shape, steps, seed=2)
    _follow(w, opt, ref, grads)
    for g in grads:
        adam.param_groups[0]["params"][0].grad = g.clone()
        adam.step()
    assert opt.state[w]["basis"].shape[1] == min(rank, *shape)
    assert (w.detach() - adam.param_groups[0]["params"][0].detach()).abs().max() > 1e-3  # not Adam


def test_limiter_actually_limits_in_the_transcribed_run():
    # Guard against a vacuous comparison: with a sudden 50x gradient the limiter must engage.
    shape, rank = (16, 24), 3
    w0 = torch.randn(shape, dtype=torch.float64)
    w = torch.nn.Parameter(w0.clone())
    opt = FiraAdamW([{"params": [w], "rank": rank}], lr=0.01, update_proj_gap=100)
    ref = Algorithm1(w0, lr=0.01, rank=rank, T=100, alpha=0.25)
    grads = _grads(shape, 6, seed=3)
    grads[4] = grads[4] * 50
    for g in grads:
        w.grad = g.clone()
        opt.step()
        ref.step(g)
    ratio = opt.state[w]["prev_norm"] / ref.S_prev_norm
    assert ratio == pytest.approx(1.0, rel=1e-10)
    torch.testing.assert_close(w.detach(), ref.W, rtol=1e-10, atol=1e-12)
