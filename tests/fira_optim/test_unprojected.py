"""Parameters that are not projected are exactly torch's optimizers (torch.equal, not allclose)."""

import pytest
import torch

from fira_optim import FiraAdamW

from .common import assert_params_equal, clone_params, grad_sequence, make_params, run

PLAIN_SHAPES = [(6, 10), (10,), (), (3, 4, 5)]  # matrix, bias, 0-d, 3-D


def _torch_state(opt):
    return [{k: v.clone() for k, v in opt.state[p].items()}
            for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("as_groups", [True, False])
def test_rank_none_group_is_torch_adamw_bitwise(weight_decay, as_groups):
    params = make_params(PLAIN_SHAPES)
    twins = clone_params(params)
    if as_groups:
        ours = FiraAdamW([{"params": params}], lr=3e-3, weight_decay=weight_decay)  # no "rank" key
    else:
        ours = FiraAdamW(params, lr=3e-3, weight_decay=weight_decay, rank=None)  # flat, rank=None
    ref = torch.optim.AdamW(twins, lr=3e-3, weight_decay=weight_decay)
    grads = grad_sequence(PLAIN_SHAPES, 7, seed=5)
    run(ours, params, grads)
    run(ref, twins, grads)
    assert_params_equal(params, twins)
    for mine, theirs in zip(_torch_state(ours), _torch_state(ref)):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
    assert (params[0] - make_params(PLAIN_SHAPES)[0]).abs().max() > 1e-3  # it did train


@pytest.mark.parametrize("shape,rank", [((6, 10), 6), ((10, 6), 6), ((6, 10), 50), ((8, 8), 8)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_rank_at_least_min_dim_is_adamw_on_the_whole_matrix(shape, rank, weight_decay):
    # No residual exists when the subspace is the whole space: plain AdamW, no basis, no SVD.
    params = make_params([shape])
    twins = clone_params(params)
    ours = FiraAdamW([{"params": params, "rank": rank, "update_proj_gap": 2}], lr=3e-3,
                     weight_decay=weight_decay)
    ref = torch.optim.AdamW(twins, lr=3e-3, weight_decay=weight_decay)
    grads = grad_sequence([shape], 6, seed=6)
    run(ours, params, grads)
    run(ref, twins, grads)
    assert_params_equal(params, twins)
    assert set(ours.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("base,make_ref", [
    ("adagrad", lambda ps: torch.optim.Adagrad(ps, lr=3e-3, eps=1e-8)),
    ("rmsprop", lambda ps: torch.optim.RMSprop(ps, lr=3e-3, alpha=0.999, eps=1e-8)),
])
def test_plain_groups_of_other_bases_are_torch_optimizers(base, make_ref):
    params = make_params(PLAIN_SHAPES)
    twins = clone_params(params)
    ours = FiraAdamW([{"params": params}], lr=3e-3, base=base)
    ref = make_ref(twins)
    grads = grad_sequence(PLAIN_SHAPES, 5, seed=7)
    run(ours, params, grads)
    run(ref, twins, grads)
    assert_params_equal(params, twins)


def test_released_arithmetic_plain_group_is_hf_style_adamw():
    # fira 1.0.2's plain groups: bias correction folded into the step size, eps added to
    # sqrt(v) unscaled, weight decay after the update with the un-corrected lr.
    lr, wd, eps, (b1, b2) = 1e-2, 0.1, 1e-8, (0.9, 0.999)
    (p,) = make_params([(5, 7)], dtype=torch.float64)
    expected = p.detach().clone()
    ours = FiraAdamW([{"params": [p]}], lr=lr, weight_decay=wd, eps=eps, arithmetic="released")
    m = torch.zeros_like(expected)
    v = torch.zeros_like(expected)
    for t, (g,) in enumerate(grad_sequence([(5, 7)], 4, seed=8, dtype=torch.float64), start=1):
        p.grad = g.clone()
        ours.step()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        expected = expected - lr * (1 - b2**t) ** 0.5 / (1 - b1**t) * m / (v.sqrt() + eps)
        expected = expected - lr * wd * expected
    torch.testing.assert_close(p.detach(), expected, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("options", [{"arithmetic": "released"}, {"base": "rmsprop"},
                                     {"base": "adagrad"}, {}])
def test_one_element_tensor_lr_of_any_shape_steps_as_the_float(options):
    # torch.optim.AdamW takes lr=torch.tensor([1e-3]); every plain path must too.
    params = make_params(PLAIN_SHAPES)
    twins = clone_params(params)
    grads = grad_sequence(PLAIN_SHAPES, 3, seed=9)
    run(FiraAdamW([{"params": params}], lr=torch.tensor([3e-3]), weight_decay=0.1, **options),
        params, grads)
    run(FiraAdamW([{"params": twins}], lr=3e-3, weight_decay=0.1, **options), twins, grads)
    assert_params_equal(params, twins)


@pytest.mark.parametrize("option", [{"foreach": True}, {"foreach": False}, {"fused": True}])
def test_foreach_and_fused_are_torch_adamws_own(option):
    """The unprojected params take torch.optim.AdamW's implementation choice as AdamW does:
    bitwise equal to AdamW given the same option; the projected matrices are not affected."""
    shapes = [*PLAIN_SHAPES[:3], (12, 20)]
    params = make_params(shapes)
    twins = clone_params(params)
    ours = FiraAdamW([{"params": params[:3]}, {"params": params[3:], "rank": 4}], lr=3e-3,
                     weight_decay=0.1, **option)
    plain = FiraAdamW([{"params": twins[:3]}, {"params": twins[3:], "rank": 4}], lr=3e-3, weight_decay=0.1)
    ref_params = clone_params(params[:3])
    ref = torch.optim.AdamW(ref_params, lr=3e-3, weight_decay=0.1, **option)
    grads = grad_sequence(shapes, 6, seed=8)
    run(ours, params, grads)
    run(plain, twins, grads)
    run(ref, ref_params, [row[:3] for row in grads])
    assert_params_equal(params[:3], ref_params)
    assert_params_equal(params[3:], twins[3:])
