"""Numerical robustness (RELIABILITY.md section D): non-finite gradients, SVD failure, zero
gradients, unsupported tensors, degenerate and pinned shapes."""

import warnings

import pytest
import torch

import fira_optim
from fira_optim import FiraAdamW, GaLoreAdamW, NonFiniteGradientError

from .common import (assert_params_equal, assert_states_equal, grad_sequence,
                     make_params, run, set_grads, state_snapshot)

SHAPES = [(12, 20), (20, 12), (16, 16), (7,)]
GAP = 3


def _optimizer(params, **options):
    return FiraAdamW([{"params": params[:3], "rank": 3, "update_proj_gap": GAP},
                      {"params": params[3:]}], lr=1e-2, weight_decay=0.01, **options)


# ---------------------------------------------------------------------- non-finite gradients


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("at_step", [0, 3, 4], ids=["first", "refresh", "steady"])
@pytest.mark.parametrize("index", [1, 3], ids=["projected", "plain"])
def test_nonfinite_gradient_raises_naming_the_param_before_any_change(index, at_step, bad,
                                                                      monkeypatch):
    params = make_params(SHAPES)
    opt = _optimizer(params)
    grads = grad_sequence(SHAPES, at_step + 1, seed=30)
    run(opt, params, grads[:at_step])
    params_before = [p.detach().clone() for p in params]
    state_before = state_snapshot(opt)
    row = [g.clone() for g in grads[at_step]]
    row[index].view(-1)[5] = bad
    set_grads(params, row)
    svd_inputs = []
    real_svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda a, *args, **kw: (
        svd_inputs.append(a.clone()) or real_svd(a, *args, **kw)))
    name = f"param_groups[{0 if index < 3 else 1}]['params'][{index if index < 3 else 0}]"
    with pytest.raises(NonFiniteGradientError, match=name.replace("[", r"\[").replace("]", r"\]")):
        opt.step()
    # Nothing was modified, including the matrix processed before the bad one.
    assert_params_equal(params, params_before)
    assert_states_equal(state_snapshot(opt), state_before)
    # The non-finite gradient never reached an SVD.
    assert all(torch.isfinite(a).all() for a in svd_inputs)


@pytest.mark.parametrize("rank", [2, None], ids=["projected", "plain"])
def test_a_non_finite_gradient_of_a_non_finite_parameter_says_the_parameter_is_the_cause(rank):
    """eps=0 (torch.optim.AdamW's rules allow it) divides 0 by 0 on a gradient entry that is 0:
    the weights go NaN without a word, and the next step's error blamed the gradient alone."""
    w = torch.nn.Parameter(torch.randn(6, 8))
    opt = FiraAdamW([{"params": [w], "rank": rank}], eps=0.0)
    grad = torch.randn(6, 8)
    grad[2] = 0
    grad[:, 3] = 0
    w.grad = grad
    opt.step()
    assert not torch.isfinite(w).all()
    w.grad = torch.randn(6, 8) * w.detach()
    with pytest.raises(NonFiniteGradientError, match=r"non-finite gradient in param_groups\[0\]\['params'\]\[0\] "
                                                     r"\(shape \(6, 8\)\) \(the parameter itself holds NaN or Inf"):
        opt.step()
    finite = torch.nn.Parameter(torch.randn(6, 8))  # a finite parameter's gradient is blamed alone
    opt = FiraAdamW([{"params": [finite], "rank": rank}])
    finite.grad = torch.full((6, 8), float("nan"))
    with pytest.raises(NonFiniteGradientError) as error:
        opt.step()
    assert "the parameter itself" not in str(error.value)


def test_nonfinite_skip_leaves_everything_unchanged_and_warns():
    grads = grad_sequence(SHAPES, 6, seed=31)
    clean = make_params(SHAPES)
    clean_opt = _optimizer(clean, nonfinite="skip")
    run(clean_opt, clean, grads)

    params = make_params(SHAPES)
    opt = _optimizer(params, nonfinite="skip")
    run(opt, params, grads[:3])
    before, state_before = [p.detach().clone() for p in params], state_snapshot(opt)
    bad = [g.clone() for g in grads[3]]
    bad[2][0, 0] = float("nan")  # at a refresh step (step 3)
    set_grads(params, bad)
    expected = r"non-finite gradient in param_groups\[0\]\['params'\]\[2\]"
    with pytest.warns(RuntimeWarning, match=expected):
        opt.step()
    assert_params_equal(params, before)
    assert_states_equal(state_snapshot(opt), state_before)  # step counts included
    # The skipped step left no trace: the run continues as if it never happened.
    run(opt, params, grads[3:])
    assert_params_equal(params, clean)
    assert_states_equal(state_snapshot(opt), state_snapshot(clean_opt))


def test_a_huge_finite_gradient_is_not_taken_for_a_nonfinite_one():
    """The finiteness check reads one norm per gradient; 1e20 entries overflow that norm in
    fp32, and the entry-by-entry recheck must still let the step run."""
    params = make_params(SHAPES)
    opt = _optimizer(params)
    grads = grad_sequence(SHAPES, 1, seed=32)[0]
    grads[3] = torch.full_like(grads[3], 1e20)
    assert not torch.isfinite(torch.linalg.vector_norm(grads[3]))
    set_grads(params, grads)
    opt.step()  # nonfinite="error": no exception
    assert all(float(opt.state[p]["step"]) == 1 for p in params)


def test_a_projected_gradient_whose_projection_overflows_is_named_as_too_large_not_non_finite():
    """A projected matrix is checked through the norms of R = P^T G, which overflow from finite
    entries of 1e19 in fp32: the step is refused, and the message no longer says "non-finite"."""
    param = torch.nn.Parameter(torch.randn(64, 96))
    opt = FiraAdamW([{"params": [param], "rank": 8}])
    param.grad = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 1e19
    assert torch.isfinite(param.grad).all()
    with pytest.raises(NonFiniteGradientError, match=r"too large for its dtype \(finite, largest entry 4\..e\+19"):
        opt.step()
    assert not opt.state[param]  # nothing was stepped
    param.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="non-finite gradient in"):
        opt.step()
    wide = torch.nn.Parameter(torch.randn(64, 96, dtype=torch.float64))  # its largest entry is no float32
    opt = FiraAdamW([{"params": [wide], "rank": 8}])
    wide.grad = torch.randn(64, 96, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1e160
    with pytest.raises(NonFiniteGradientError, match=r"finite, largest entry 3\.89e\+160"):
        opt.step()


# ---------------------------------------------------------------------- SVD failure


def _failing_svd(monkeypatch, fail_dtypes):
    real_svd = torch.linalg.svd
    calls = []

    def svd(a, *args, **kwargs):
        calls.append(a.dtype)
        if a.dtype in fail_dtypes:
            raise torch.linalg.LinAlgError("simulated: the algorithm failed to converge")
        return real_svd(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", svd)
    return calls


def test_svd_failure_is_retried_in_float64(monkeypatch):
    params = make_params(SHAPES)
    opt = _optimizer(params)
    grads = grad_sequence(SHAPES, 1, seed=32)
    calls = _failing_svd(monkeypatch, {torch.float32})
    set_grads(params, grads[0])
    with pytest.warns(RuntimeWarning, match="retrying in float64"):
        opt.step()
    assert calls.count(torch.float64) == 3
    # The basis is the float64 SVD's, in the working dtype: the top singular vectors.
    g = grads[0][0].double()  # wide: left basis = U[:, :3]
    basis = opt.state[params[0]]["basis"]
    assert basis.dtype == torch.float32
    monkeypatch.undo()
    u, _, _ = torch.linalg.svd(g, full_matrices=False)
    torch.testing.assert_close(basis.double() @ basis.double().T, u[:, :3] @ u[:, :3].T,
                               rtol=1e-5, atol=1e-6)
    assert all(torch.isfinite(p).all() for p in params)


def test_svd_failure_twice_keeps_the_previous_basis_and_warns(monkeypatch):
    params = make_params(SHAPES)
    opt = _optimizer(params)
    grads = grad_sequence(SHAPES, 5, seed=33)
    run(opt, params, grads[:3])
    bases = [opt.state[p]["basis"].clone() for p in params[:3]]
    _failing_svd(monkeypatch, {torch.float32, torch.float64})
    set_grads(params, grads[3])  # step 3: a refresh step
    before = [p.detach().clone() for p in params]
    with pytest.warns(RuntimeWarning) as record:
        opt.step()
    messages = [str(w.message) for w in record]
    assert sum("retrying in float64" in m for m in messages) == 3
    assert sum("keeping the previous basis" in m for m in messages) == 3
    for p, b in zip(params[:3], bases):
        assert torch.equal(opt.state[p]["basis"], b)
    for p, b in zip(params, before):  # the run went on
        assert torch.isfinite(p).all() and not torch.equal(p, b)
    run(opt, params, grads[4:])  # and keeps going
    assert all(int(opt.state[p]["step"]) == 5 for p in params)


def test_svd_failure_at_the_first_step_uses_a_random_orthonormal_basis(monkeypatch):
    params = make_params(SHAPES)
    opt = _optimizer(params)
    _failing_svd(monkeypatch, {torch.float32, torch.float64})
    set_grads(params, grad_sequence(SHAPES, 1, seed=34)[0])
    with pytest.warns(RuntimeWarning) as record:
        opt.step()
    messages = [str(w.message) for w in record]
    assert sum("retrying in float64" in m for m in messages) == 3
    assert sum("using a random basis" in m for m in messages) == 3
    for p in params[:3]:
        basis = opt.state[p]["basis"]
        assert basis.abs().sum() > 0
        torch.testing.assert_close(basis.T @ basis, torch.eye(3), rtol=1e-5, atol=1e-5)
        assert torch.isfinite(p).all()


# ---------------------------------------------------------------------- zero gradients


def test_all_zero_gradient_at_a_refresh_keeps_the_basis():
    params = make_params(SHAPES)
    opt = _optimizer(params)
    grads = grad_sequence(SHAPES, 3, seed=35)
    run(opt, params, grads)
    bases = [opt.state[p]["basis"].clone() for p in params[:3]]
    set_grads(params, [torch.zeros_like(p) for p in params])  # step 3: a refresh step
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a zero gradient is not a failure: no warning either
        opt.step()
    for p, b in zip(params[:3], bases):
        assert torch.equal(opt.state[p]["basis"], b)
        assert torch.isfinite(p).all()
        assert int(opt.state[p]["step"]) == 4


@pytest.mark.parametrize("implementation", ["fast", "reference"])
def test_limiter_skips_when_the_previous_norm_is_zero(implementation):
    # A zero gradient after the first step leaves a zero residual, so the stored norm is 0:
    # the next residual, however large, is taken as it is (no history), not clamped to
    # gamma * eps. The control run (a normal gradient in between) shows the limiter engaging.
    shape = (12, 20)
    grads = grad_sequence([shape], 3, seed=36, dtype=torch.float64)
    first, middle, big = grads[0][0], grads[1][0], 50 * grads[2][0]
    results = {}
    for limiter in ("growth", "none"):
        for between in ("zero", "normal"):
            w = make_params([shape], dtype=torch.float64)[0]
            opt = FiraAdamW([{"params": [w], "rank": 3, "update_proj_gap": 100}], lr=1e-2,
                            limiter=limiter, implementation=implementation)
            second = torch.zeros(shape, dtype=torch.float64) if between == "zero" else middle
            for g in (first, second):
                w.grad = g.clone()
                opt.step()
            if between == "zero":
                assert float(opt.state[w]["prev_norm"]) == 0.0
            w.grad = big.clone()
            opt.step()
            results[limiter, between] = w.detach().clone()
    torch.testing.assert_close(results["growth", "zero"], results["none", "zero"],
                               rtol=1e-13, atol=1e-15)
    assert (results["growth", "normal"] - results["none", "normal"]).abs().max() > 1e-3


# ---------------------------------------------------------------------- unsupported tensors


@pytest.mark.parametrize("shape", [(7,), (3, 4, 5), ()])
def test_non_matrix_in_a_projected_group_raises_at_construction(shape):
    params = make_params([(12, 20), shape])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] has shape"):
        FiraAdamW([{"params": params, "rank": 3}])
    opt = FiraAdamW([{"params": params[:1], "rank": 3}])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\]"):
        opt.add_param_group({"params": params[1:], "rank": 3})


@pytest.mark.parametrize("projected", [True, False])
def test_sparse_gradient_raises_at_step(projected):
    emb = torch.nn.Embedding(10, 14, sparse=True)
    group = {"params": [emb.weight], "rank": 3} if projected else {"params": [emb.weight]}
    opt = FiraAdamW([group], lr=1e-2)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    assert emb.weight.grad.is_sparse
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(emb.weight, before)


@pytest.mark.parametrize("options", [{"rank": 3}, {"rank": None, "state_dtype": "bfloat16"}])
def test_complex_params_raise_where_they_cannot_be_stepped(options):
    p = torch.nn.Parameter(torch.randn(8, 12, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is complex .*rank=None"):
        FiraAdamW([{"params": [p], **options}])
    half = torch.nn.Parameter(torch.randn(8, 12, dtype=torch.complex64).to(torch.complex32))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is complex32"):
        FiraAdamW([{"params": [half]}])


@pytest.mark.parametrize("foreach", [False, True])
def test_complex_params_of_a_plain_group_step_as_torch_adamw(foreach):
    """A rank=None group is torch.optim.AdamW for complex parameters too (real views of them);
    a flat list puts a complex matrix there by itself."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(8, 12, dtype=torch.complex64)), torch.nn.Parameter(torch.randn(5))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    fira = FiraAdamW(ours, lr=1e-2, weight_decay=0.1, rank=4, foreach=foreach)
    assert [g["rank"] for g in fira.param_groups] == [None]  # the complex matrix is not projected
    layer = torch.nn.Linear(12, 8, dtype=torch.complex64)
    assert [g["rank"] for g in fira_optim.param_groups(torch.nn.Sequential(layer), rank=4)] == [None]
    reference = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=foreach)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        fira.step()
        reference.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
    assert fira.state[ours[0]]["exp_avg"].dtype == torch.complex64
    assert torch.equal(fira.state[ours[0]]["exp_avg_sq"], reference.state[theirs[0]]["exp_avg_sq"])


@pytest.mark.parametrize("cls", [FiraAdamW, GaLoreAdamW])
def test_empty_matrices_do_not_crash(cls):
    shapes = [(0, 8), (8, 0), (12, 20), (0,)]
    params = make_params(shapes)
    opt = cls([{"params": params[:3], "rank": 3, "update_proj_gap": 2}, {"params": params[3:]}],
              lr=1e-2, weight_decay=0.1)
    before = params[2].detach().clone()
    run(opt, params, grad_sequence(shapes, 4, seed=37))
    assert params[0].shape == (0, 8) and params[1].shape == (8, 0)
    assert not torch.equal(params[2], before)
    opt.load_state_dict(opt.state_dict())
    run(opt, params, grad_sequence(shapes, 1, seed=38))


# ---------------------------------------------------------------------- shapes


@pytest.mark.parametrize("proj_type,shape,side", [
    ("std", (12, 20), "left"), ("std", (20, 12), "right"), ("std", (16, 16), "right"),
    ("reverse_std", (12, 20), "right"), ("reverse_std", (20, 12), "left"),
    ("reverse_std", (16, 16), "left"),
    ("left", (20, 12), "left"), ("right", (12, 20), "right"),
])
def test_projection_side_and_state_shapes_are_pinned(proj_type, shape, side):
    # "std" is the released tie rule: a square matrix is projected on the right.
    m, n = shape
    rank = 3
    w = make_params([shape], dtype=torch.float64)[0]
    opt = FiraAdamW([{"params": [w], "rank": rank, "proj_type": proj_type}], lr=1e-2)
    (g,) = grad_sequence([shape], 1, seed=39, dtype=torch.float64)[0]
    w.grad = g.clone()
    opt.step()
    state = opt.state[w]
    basis = state["basis"]
    if side == "left":  # P: m x r, R = P^T G: r x n, one scaling factor per column
        assert basis.shape == (m, rank) and state["exp_avg"].shape == (rank, n)
        u = torch.linalg.svd(g, full_matrices=False)[0][:, :rank]
    else:  # Q: n x r, R = G Q: m x r, one scaling factor per row
        assert basis.shape == (n, rank) and state["exp_avg"].shape == (m, rank)
        u = torch.linalg.svd(g, full_matrices=False)[2][:rank].T
    # The basis spans the top-r singular subspace of the gradient on its side.
    torch.testing.assert_close(basis @ basis.T, u @ u.T, rtol=1e-10, atol=1e-12)


def test_square_matrices_follow_the_tie_rule_in_both_classes():
    for cls in (FiraAdamW, GaLoreAdamW):
        w = make_params([(9, 9)])[0]
        opt = cls([{"params": [w], "rank": 2}], lr=1e-2)
        w.grad = torch.randn(9, 9)
        opt.step()
        assert opt.state[w]["exp_avg"].shape == (9, 2)  # right: R = G Q is m x r
        assert opt.state[w]["basis"].shape == (9, 2)


@pytest.mark.parametrize("options", [{"base": "adagrad"}, {"base": "rmsprop"}, {"arithmetic": "released"}])
def test_a_complex_parameter_steps_as_its_real_view(options):
    torch.manual_seed(0)
    z = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.complex64))
    real = torch.nn.Parameter(torch.view_as_real(z.detach()).clone())
    ours = FiraAdamW([{"params": [z]}], lr=1e-2, weight_decay=0.1, **options)
    theirs = FiraAdamW([{"params": [real]}], lr=1e-2, weight_decay=0.1, **options)
    for _ in range(3):
        g = torch.randn_like(z)
        z.grad, real.grad = g, torch.view_as_real(g).clone()
        ours.step()
        theirs.step()
    assert torch.equal(torch.view_as_real(z.detach()), real.detach())
    loaded = FiraAdamW([{"params": [z]}], lr=1e-2, weight_decay=0.1, **options)
    loaded.load_state_dict(ours.state_dict())  # complex moments round-trip
    assert all(torch.equal(a, b) for a, b in zip(loaded.state[z].values(), ours.state[z].values()))


def test_a_non_finite_complex_gradient_is_caught_before_anything_changes():
    z = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.complex64))
    before = z.detach().clone()
    optimizer = FiraAdamW([{"params": [z]}], lr=1e-2)
    z.grad = torch.randn_like(z)
    z.grad[0, 0] = complex(float("nan"), 0.0)
    with pytest.raises(NonFiniteGradientError):
        optimizer.step()
    assert torch.equal(z.detach(), before)


def test_a_parameter_given_by_name_is_named_in_the_error():
    """model.named_parameters(): torch keeps the names in the groups (param_names); the errors
    named the place in the groups alone, which inside a Trainer says little."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    opt = FiraAdamW(model.named_parameters(), rank=2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[1].weight.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"non-finite gradient in 1\.weight \(param_groups\[0\]\['params'\]"
                                                     r"\[1\], shape \(4, 6\)\)"):
        opt.step()
