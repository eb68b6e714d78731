"""Optimizer behaviour (RELIABILITY.md section A): training, per-group options, no-ops, dtypes,
state size, hooks, printing and copying."""

import copy
import math

import pytest
import torch

import fira_optim.refresh as refresh
from fira_optim import VARIANTS, FiraAdamW, GaLoreAdamW, optimizer_state_numel

from .common import (assert_params_equal, assert_states_equal, clone_params, grad_sequence,
                     make_params, run, set_grads, state_snapshot)


# ---------------------------------------------------------------------- training


def _regression_problem():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    teacher = torch.randn(8, 16, generator=g)
    return x, torch.sin(x @ teacher.T)


def _regression_params():
    g = torch.Generator().manual_seed(0)
    # A non-contiguous weight (a transposed view) and a contiguous one.
    w1 = torch.nn.Parameter((torch.randn(16, 32, generator=g) * 0.25).t())  # 32 x 16
    b1 = torch.nn.Parameter(torch.zeros(32))
    w2 = torch.nn.Parameter(torch.randn(8, 32, generator=g) * 0.18)
    return w1, b1, w2


def _warmup_cosine(step: int) -> float:
    return min(1.0, (step + 1) / 5) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / 20)))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_loss_goes_down_with_a_scheduler(variant):
    x, y = _regression_problem()
    w1, b1, w2 = _regression_params()
    assert not w1.is_contiguous() and w2.is_contiguous()
    opt = FiraAdamW([{"params": [w1, w2], "rank": 4, "update_proj_gap": 5}, {"params": [b1]}],
                    lr=3e-2, **VARIANTS[variant])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = ((torch.tanh(x @ w1.T + b1) @ w2.T - y) ** 2).mean()
        loss.backward()
        opt.step()
        scheduler.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.85 * losses[0], losses
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-2 * _warmup_cosine(20))
    assert not w1.is_contiguous()  # updated in place, layout kept


def test_step_with_closure_returns_the_loss():
    x, y = _regression_problem()
    w1, b1, w2 = _regression_params()
    opt = FiraAdamW([{"params": [w1, w2], "rank": 4}, {"params": [b1]}], lr=1e-2)

    def closure():
        opt.zero_grad()
        loss = ((torch.tanh(x @ w1.T + b1) @ w2.T - y) ** 2).mean()
        loss.backward()
        return loss

    before = w2.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert not torch.equal(before, w2)


# ---------------------------------------------------------------------- per-group options


@pytest.mark.parametrize("arithmetic", ["paper", "released"])
@pytest.mark.parametrize("projected", [True, False], ids=["projected", "plain"])
def test_per_group_lr_and_weight_decay_apply(projected, arithmetic):
    shape = (10, 14)
    base = make_params([shape], dtype=torch.float64)[0]  # fp64: differences of deltas are exact
    a, b, c = (clone_params([base])[0] for _ in range(3))
    rank = {"rank": 3} if projected else {}
    opt = FiraAdamW([
        {"params": [a], "lr": 1e-2, **rank},
        {"params": [b], "lr": 2e-2, **rank},
        {"params": [c], "lr": 1e-2, "weight_decay": 0.1, **rank},
    ], weight_decay=0.0, arithmetic=arithmetic)
    (g,) = grad_sequence([shape], 1, seed=2, dtype=torch.float64)[0]
    set_grads([a, b, c], [g, g, g])
    opt.step()
    w0 = base.detach()
    delta_a, delta_b = a.detach() - w0, b.detach() - w0
    assert delta_a.abs().max() > 1e-4
    # Twice the learning rate, twice the step (the update does not otherwise depend on lr).
    torch.testing.assert_close(delta_b, 2 * delta_a, rtol=1e-9, atol=1e-13)
    # Decoupled weight decay: the only difference is lr * wd * W (before the update in the
    # paper arithmetic, after it in the released one).
    w_before_decay = w0 if arithmetic == "paper" else a.detach()
    torch.testing.assert_close(c.detach() - a.detach(), -1e-2 * 0.1 * w_before_decay,
                               rtol=1e-9, atol=1e-13)


def test_tiny_lr_group_is_bitwise_unchanged():
    params = make_params([(10, 14), (14, 10), (10,), (10, 14)])
    before = [p.detach().clone() for p in params]
    opt = FiraAdamW([
        {"params": params[:2], "rank": 3, "lr": 1e-28, "update_proj_gap": 2},
        {"params": params[2:3], "lr": 1e-28},
        {"params": params[3:], "rank": 3, "update_proj_gap": 2},  # the default lr
    ], lr=1e-2, weight_decay=0.0)
    run(opt, params, grad_sequence([tuple(p.shape) for p in params], 5, seed=3))
    assert_params_equal(params[:3], before[:3])
    assert not torch.equal(params[3], before[3])


def test_param_without_grad_is_unchanged_even_with_weight_decay():
    params = make_params([(10, 14), (10, 14), (6,)])
    before = [p.detach().clone() for p in params]
    opt = FiraAdamW([{"params": params[:2], "rank": 3}, {"params": params[2:]}],
                    lr=1e-2, weight_decay=0.1)
    grads = grad_sequence([(10, 14)], 4, seed=4)
    for (g,) in grads:
        set_grads(params, [g, None, None])
        opt.step()
    assert_params_equal(params[1:], before[1:])
    assert not opt.state.get(params[1]) and not opt.state.get(params[2])
    assert not torch.equal(params[0], before[0])


@pytest.mark.parametrize("variant", ["fira", "galore", "fira-adagrad", "fira-released"])
def test_zero_gradients_on_a_fresh_optimizer_change_nothing(variant):
    shapes = [(10, 14), (14, 10), (6,), ()]
    params = make_params(shapes)
    twins = clone_params(params)
    before = [p.detach().clone() for p in params]
    kw = dict(lr=1e-2, weight_decay=0.0, **VARIANTS[variant])
    opt = FiraAdamW([{"params": params[:2], "rank": 3, "update_proj_gap": 3},
                     {"params": params[2:]}], **kw)
    set_grads(params, [torch.zeros(s) for s in shapes])
    opt.step()
    opt.step()
    assert_params_equal(params, before)
    for p in params[:2]:  # state exists with its final layout, but no basis was derived
        assert int(opt.state[p]["step"]) == 0
        assert not opt.state[p]["basis"].any()
    # No refresh came from the zero SVD: the first real step derives the basis from the real
    # gradient, exactly as a fresh optimizer does.
    fresh = FiraAdamW([{"params": twins[:2], "rank": 3, "update_proj_gap": 3},
                       {"params": twins[2:]}], **kw)
    grads = grad_sequence(shapes, 4, seed=5)
    run(opt, params, grads)
    run(fresh, twins, grads)
    assert_params_equal(params, twins)
    assert_states_equal(state_snapshot(opt), state_snapshot(fresh))


# ---------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_are_kept_and_the_svd_runs_in_at_least_fp32(dtype, monkeypatch):
    """State dtype policy: the basis, the low-rank moments and the limiter history of a projected
    matrix are kept in ``promote_types(param.dtype, float32)`` -- fp32 for bf16/fp16 params (so
    the small states do not lose the precision the SVD and Adam need), the param's own dtype
    for fp32/fp64. Plain (unprojected) params keep torch's policy, state in the param dtype,
    except fp16, whose moments are fp32 (fp16 Adam moments give 0 / 0 at zero gradients)."""
    seen = []
    real_svd = torch.linalg.svd

    def recording_svd(a, *args, **kwargs):
        seen.append(a.dtype)
        return real_svd(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", recording_svd)
    shapes = [(10, 14), (14, 10), (6,)]
    initial = [p.detach().to(dtype) for p in make_params(shapes)]
    params = [torch.nn.Parameter(p.clone()) for p in initial]
    reference = [torch.nn.Parameter(p.float().clone()) for p in initial]  # same start, fp32
    work = torch.promote_types(dtype, torch.float32)
    grads = grad_sequence(shapes, 4, seed=6)
    states = []
    for ps in (params, reference):
        opt = FiraAdamW([{"params": ps[:2], "rank": 3, "update_proj_gap": 2}, {"params": ps[2:]}],
                        lr=5e-2)
        run(opt, ps, [[g.to(ps[0].dtype) for g in row] for row in grads])
        states.append(opt.state)
        if ps is params:
            svd_dtypes = set(seen)
    assert svd_dtypes == {work}  # two refreshes ran, never a bf16/fp16 SVD (CPU has none)
    state = states[0]
    for p, p0 in zip(params, initial):
        assert p.dtype == dtype and torch.isfinite(p).all()
        assert not torch.equal(p, p0)
    for p in params[:2]:
        for key in ("basis", "exp_avg", "exp_avg_sq", "prev_norm"):
            assert state[p][key].dtype == work, key
    assert state[params[2]]["exp_avg"].dtype == (torch.float32 if dtype == torch.float16 else dtype)
    # The low-precision run tracks the fp32 run to the precision of its dtype.
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3}.get(dtype, 1e-5)
    for p, q in zip(params, reference):
        torch.testing.assert_close(p.float(), q.detach(), rtol=tol, atol=tol)


# ---------------------------------------------------------------------- state size


@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (16, 16)])
@pytest.mark.parametrize("cls,extra", [(FiraAdamW, 1), (GaLoreAdamW, 0)])
def test_state_numel_is_the_design_formula(shape, cls, extra):
    # Per projected m x n matrix: basis min(m, n) x r, two moments r x max(m, n), and (Fira
    # only) the limiter's previous norm; step counters are not counted.
    rank = 3
    params = make_params([shape, (7,)])
    opt = cls([{"params": params[:1], "rank": rank}, {"params": params[1:]}], lr=1e-2)
    run(opt, params, grad_sequence([shape, (7,)], 2, seed=7))
    small, large = min(shape), max(shape)
    assert optimizer_state_numel(opt) == small * rank + 2 * large * rank + extra + 2 * 7
    assert optimizer_state_numel(opt, count_steps=True) == optimizer_state_numel(opt) + 2
    # No hidden full-size buffer anywhere in the state.
    assert all(v.numel() < shape[0] * shape[1] for s in opt.state.values() for v in s.values())


# ---------------------------------------------------------------------- hooks, repr, copy


def test_hooks_fire():
    params = make_params([(10, 14), (6,)])
    opt = FiraAdamW([{"params": params[:1], "rank": 3}, {"params": params[1:]}], lr=1e-2)
    fired = []
    opt.register_step_pre_hook(lambda o, args, kwargs: fired.append("step_pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: fired.append("step_post"))
    opt.register_state_dict_pre_hook(lambda o: fired.append("state_dict_pre"))
    opt.register_state_dict_post_hook(lambda o, sd: fired.append("state_dict_post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: fired.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: fired.append("load_post"))
    run(opt, params, grad_sequence([(10, 14), (6,)], 1, seed=8))
    opt.load_state_dict(opt.state_dict())
    assert fired == ["step_pre", "step_post", "state_dict_pre", "state_dict_post",
                     "load_pre", "load_post"]


def test_repr_names_the_class_and_the_options():
    params = make_params([(10, 14), (6,)])
    text = repr(GaLoreAdamW([{"params": params[:1], "rank": 3}, {"params": params[1:]}]))
    assert text.startswith("GaLoreAdamW (")
    assert "Parameter Group 1" in text and "rank: 3" in text and "residual: drop" in text


@pytest.mark.parametrize("implementation,nonfinite", [("reference", "skip"), ("fast", "error")])
def test_deepcopy_is_an_independent_identical_optimizer(implementation, nonfinite):
    shapes = [(10, 14), (6,)]
    params = make_params(shapes)
    opt = FiraAdamW([{"params": params[:1], "rank": 3, "update_proj_gap": 2},
                     {"params": params[1:]}], lr=1e-2, implementation=implementation,
                    nonfinite=nonfinite)
    grads = grad_sequence(shapes, 5, seed=9)
    run(opt, params, grads[:2])
    twin = copy.deepcopy(opt)
    assert twin.implementation == implementation and twin.nonfinite == nonfinite
    assert copy.deepcopy(FiraAdamW(params[:1], rank=3, split_refresh=True)).split_refresh is True
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert all(p is not q for p, q in zip(params, twin_params))
    assert_params_equal(params, twin_params)
    assert_states_equal(state_snapshot(opt), state_snapshot(twin))
    run(opt, params, grads[2:])
    run(twin, twin_params, grads[2:])
    assert_params_equal(params, twin_params)
    assert_states_equal(state_snapshot(opt), state_snapshot(twin))


def test_pool_workers_decompose_on_one_intra_op_thread(monkeypatch):
    """Two workers that each ask for every core would oversubscribe them: each SVD in the pool
    runs on one torch thread, a lone one too, and the step leaves the thread count as it found it."""
    import fira_optim.projection as projection

    shapes = [(12, 20), (20, 12), (16, 16)]
    grads = grad_sequence(shapes, 2, seed=6)
    svd = torch.linalg.svd
    counts = []
    monkeypatch.setattr(projection.torch.linalg, "svd",
                        lambda a, **kw: counts.append(torch.get_num_threads()) or svd(a, **kw))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = make_params(shapes)
        run(FiraAdamW(params, rank=3, update_proj_gap=5), params, grads)
        assert counts == [1, 1, 1] and torch.get_num_threads() == 2
        counts.clear()  # one matrix due: no pool, its SVD on one thread too (LAPACK's result
        # depends on the thread count), and the caller's count is given back
        params = make_params(shapes[:1])
        run(FiraAdamW(params, rank=3, update_proj_gap=5), params, [g[:1] for g in grads])
        assert counts == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_thread_started_after_a_pooled_refresh_keeps_the_caller_s_thread_count():
    """torch.set_num_threads also sets the count that a thread takes at its first parallel call:
    the pool's workers set 1, which every thread started after the refresh then ran on."""
    import threading

    shapes = [(12, 20), (20, 12), (16, 16)]
    grads = grad_sequence(shapes, 1, seed=6)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = make_params(shapes)
        run(FiraAdamW(params, rank=3, update_proj_gap=5), params, grads)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert seen == [2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_refreshes_computed_in_threads_equal_the_sequential_ones(monkeypatch):
    """On the CPU with 2+ torch threads, the SVDs due at one step run side by side in a
    thread pool; the run is bitwise the one where each matrix refreshes in its turn (each on one
    thread, as the workers: LAPACK's result depends on the thread count from a few hundred rows)."""
    import threading

    import fira_optim.projection as projection

    shapes = [(12, 20), (20, 12), (16, 16), (9, 30), (7,)]
    grads = grad_sequence(shapes, 7, seed=5)
    svd = torch.linalg.svd
    threads = []
    monkeypatch.setattr(projection.torch.linalg, "svd",
                        lambda a, **kw: threads.append(threading.get_ident()) or svd(a, **kw))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)

    def train(sequential):
        if sequential:
            monkeypatch.setattr(refresh, "refresh_in_threads", lambda opt, total, only: None)
        params = make_params(shapes)
        opt = FiraAdamW([{"params": params[:4], "rank": 3, "update_proj_gap": 3}, {"params": params[4:]}],
                        lr=1e-2)
        run(opt, params, grads)
        return params, opt

    params, opt = train(sequential=False)
    in_pool = {t for t in threads if t != threading.get_ident()}
    threads.clear()
    seq_params, seq_opt = train(sequential=True)
    assert in_pool and set(threads) == {threading.get_ident()}
    assert_params_equal(params, seq_params)
    assert_states_equal(state_snapshot(opt), state_snapshot(seq_opt))


def test_host_refresh_is_a_bool_kept_by_copies_and_a_no_op_on_the_cpu():
    with pytest.raises(ValueError, match="Invalid host_refresh: 'yes'"):
        FiraAdamW([torch.nn.Parameter(torch.zeros(4, 4))], host_refresh="yes")
    shapes = [(12, 20), (20, 12), (16, 16)]
    grads = grad_sequence(shapes, 5, seed=8)
    runs = []
    for host_refresh in (False, True):
        params = make_params(shapes)
        opt = FiraAdamW(params, rank=3, update_proj_gap=2, host_refresh=host_refresh)
        assert copy.deepcopy(opt).host_refresh is host_refresh
        run(opt, params, grads)
        runs.append(params)
    assert_params_equal(*runs)  # on the CPU the refresh already runs on the host


def _bf16_step(monkeypatch, threads, inspect=None):
    shapes = [(12, 20), (20, 12), (16, 16)]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    opt = FiraAdamW(params, rank=3, update_proj_gap=2)
    if inspect is not None:
        inspect(opt)
    for _ in range(3):
        opt.step()
    return params


def test_bf16_gradients_are_converted_to_fp32_one_matrix_at_a_time(monkeypatch):
    """Neither the refresh pool's jobs nor the planned matrices hold fp32 copies of bf16
    gradients (they would coexist: twice the bf16 weights); the results are those of the
    sequential refresh."""
    due_grads, held = [], []
    due = refresh.due_refreshes

    def recorded(optimizer, total, only=None):
        pairs = due(optimizer, total, only)
        due_grads.extend(job.grad for _, job in pairs)
        return pairs

    def inspect(opt):
        update = opt._update

        def checked(matrices, stats):
            held.extend((m.grad, m.source, m.param.grad) for m, _ in matrices)
            return update(matrices, stats)

        monkeypatch.setattr(opt, "_update", checked)

    monkeypatch.setattr(refresh, "due_refreshes", recorded)
    pooled = _bf16_step(monkeypatch, 2, inspect)
    assert len(due_grads) == 6 and all(g.dtype == torch.bfloat16 for g in due_grads)  # 2 refreshes
    assert len(held) == 9 and all(grad is None and source is own for grad, source, own in held)
    sequential = _bf16_step(monkeypatch, 1)
    for a, b in zip(pooled, sequential):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_no_refresh_jobs_are_built_off_the_cpu_without_host_refresh(monkeypatch):
    opt = FiraAdamW([torch.nn.Parameter(torch.empty(8, 8, device="meta"))], rank=2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(refresh, "due_refreshes", lambda optimizer, total, only=None: pytest.fail("jobs built"))
    assert refresh.refresh_in_threads(opt, None) is None
