"""The strategies of the stages (:mod:`fira_optim.pipeline`): the fast path against the readable
reference path, and what the fast path allocates."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fira_optim import VARIANTS, FiraAdamW, precision

from .common import grad_sequence, make_params

# wide (left), tall (right), square (right by the tie rule), a matrix whose grad is sometimes
# None, a frozen matrix, then a bias and a 0-d parameter in the plain group.
PROJECTED = [(12, 20), (20, 12), (16, 16), (14, 10), (10, 14)]
PLAIN = [(10,), ()]
SOMETIMES_NONE, FROZEN = 3, 4
NONE_AT = {1, 4, 5}
STEPS, GAP, RANK = 8, 3, 4
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def _build(dtype, implementation, variant, stagger, proj_type="std"):
    params = make_params(PROJECTED + PLAIN, seed=11, dtype=dtype)
    # A non-contiguous projected weight (a transposed view, as after a .t() in user code).
    params[2] = torch.nn.Parameter(params[2].detach().clone().t())
    params[FROZEN].requires_grad_(False)
    groups = [
        {"params": params[: len(PROJECTED)], "rank": RANK, "update_proj_gap": GAP,
         "stagger": stagger, "proj_type": proj_type},
        {"params": params[len(PROJECTED):]},
    ]
    opt = FiraAdamW(groups, lr=1e-2, weight_decay=0.05, implementation=implementation,
                    **VARIANTS[variant])
    return params, opt


def _grads(dtype):
    rows = grad_sequence(PROJECTED + PLAIN, STEPS, seed=12, dtype=dtype)
    for k, row in enumerate(rows):
        row[FROZEN] = None
        if k in NONE_AT:
            row[SOMETIMES_NONE] = None
    return rows


def _train(dtype, implementation, variant, stagger, monkeypatch, proj_type="std"):
    calls = {"fast": 0}

    def counting_fast(_opt, stats):
        # matrices updated by the (multi-tensor) fast path
        calls["fast"] += sum(s.strategy == "fast" for s in stats)

    params, opt = _build(dtype, implementation, variant, stagger, proj_type)
    opt.register_step_stats_hook(counting_fast)
    frozen_before = params[FROZEN].detach().clone()
    for row in _grads(dtype):
        for p, g in zip(params, row):
            p.grad = None if g is None else g.clone()
        opt.step()
    assert torch.equal(params[FROZEN], frozen_before)
    assert not opt.state.get(params[FROZEN])  # a frozen matrix gets no state at all
    return params, opt, calls["fast"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("stagger", [False, True], ids=["aligned", "stagger"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fast_path_matches_reference(variant, stagger, dtype, monkeypatch):
    fast_params, fast_opt, fast_calls = _train(dtype, "fast", variant, stagger, monkeypatch)
    ref_params, ref_opt, ref_calls = _train(dtype, "reference", variant, stagger, monkeypatch)
    assert ref_calls == 0
    if VARIANTS[variant].get("residual") == "sign":
        assert fast_calls == 0  # FRUGAL's sign residual has no fused form: reference both times
    else:
        # 3 always-present trainable matrices x 8 steps + the sometimes-None one on 5 steps.
        assert fast_calls == 3 * STEPS + (STEPS - len(NONE_AT))
    for i, (p, q) in enumerate(zip(fast_params, ref_params)):
        assert p.dtype == dtype
        torch.testing.assert_close(p, q, **TOL[dtype], msg=lambda m: f"param {i}: {m}")
    for p, q in zip(fast_params, ref_params):
        mine, theirs = fast_opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert mine.keys() == theirs.keys()
        for key in mine:
            torch.testing.assert_close(mine[key], theirs[key], **TOL[dtype], msg=key)
    # The sometimes-None matrix counted only the steps on which it had a gradient.
    assert int(fast_opt.state[fast_params[SOMETIMES_NONE]]["step"]) == STEPS - len(NONE_AT)


@pytest.mark.parametrize("proj_type", ["reverse_std", "left", "right"])
@pytest.mark.parametrize("variant", ["fira", "fira-released", "fira-matrix", "fira-only-scaling"])
def test_fast_path_matches_reference_for_forced_sides(variant, proj_type, monkeypatch):
    dtype = torch.float64
    fast_params, _, _ = _train(dtype, "fast", variant, False, monkeypatch, proj_type)
    ref_params, _, _ = _train(dtype, "reference", variant, False, monkeypatch, proj_type)
    for p, q in zip(fast_params, ref_params):
        torch.testing.assert_close(p, q, **TOL[dtype])


def _large_allocations(opt, w, shape):
    """Allocations of at least m * n * 4 bytes made during one (non-refresh) opt.step()."""
    w.grad = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    opt.step()  # first step: state, SVD (allowed to allocate)
    w.grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    threshold = shape[0] * shape[1] * 4
    # self: each allocation once, by the op that made it (not again by the ops around it)
    return [(e.name, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage >= threshold]


@pytest.mark.parametrize("shape", [(256, 512), (512, 256)], ids=["left", "right"])
@pytest.mark.parametrize("variant", ["fira", "galore", "fira-matrix", "fira-only-scaling",
                                     "fira-released"])
def test_fast_path_allocates_no_full_size_temporaries(variant, shape):
    big = {}
    for implementation in ("fast", "reference"):
        w = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
        opt = FiraAdamW([{"params": [w], "rank": 16, "update_proj_gap": 100}],
                        implementation=implementation, **VARIANTS[variant])
        big[implementation] = _large_allocations(opt, w, shape)
    # The measurement works (the reference path forms m x n terms explicitly) ...
    assert big["reference"], "profiler saw no m x n allocation in the reference path"
    # ... and the fused path makes none: only r x n / m x r / per-column temporaries.
    assert big["fast"] == []


@pytest.mark.parametrize("shape", [(256, 512), (512, 256)], ids=["left", "right"])
@pytest.mark.parametrize("variant,most", [("fira", 2), ("fira-released", 2), ("frugal", 2), ("galore", 1),
                                          ("fira-only-scaling", 1)])
def test_reference_path_forms_its_terms_in_at_most_two_buffers(variant, most, shape):
    """The reference path (and FRUGAL's sign residual, which has only it) forms S in P R's
    buffer and the update in P N's: at most two m x n allocations per step (before, one per
    term: seven for Fira), so its peak is two matrices beside the gradient, not six."""
    w = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    opt = FiraAdamW([{"params": [w], "rank": 16, "update_proj_gap": 100}],
                    implementation="reference", **VARIANTS[variant])
    assert len(_large_allocations(opt, w, shape)) == most


@pytest.mark.parametrize("variant", ["fira", "galore", "fira-released", "fira-only-scaling"])
@pytest.mark.parametrize("rounding", [False, True], ids=["nearest", "stochastic"])
def test_fast_path_matches_reference_for_bf16_weights(variant, rounding, monkeypatch):
    """bf16 weights take the fast path on an fp32 working copy, rounded once, as the reference
    does: the same weights but where the fp32 results of the two paths fall on either side of a
    bf16 rounding boundary (one ulp); with stochastic rounding, the same random bits."""
    runs = {}
    for implementation in ("fast", "reference"):
        params = make_params(PROJECTED[:3], seed=11, dtype=torch.bfloat16)
        opt = FiraAdamW([{"params": params, "rank": RANK, "update_proj_gap": GAP}], lr=1e-2,
                        weight_decay=0.05, implementation=implementation, stochastic_rounding=rounding,
                        **VARIANTS[variant])
        used = set()
        opt.register_step_stats_hook(lambda _opt, stats: used.update(s.strategy for s in stats))
        for row in grad_sequence(PROJECTED[:3], STEPS, seed=12, dtype=torch.bfloat16):
            for p, g in zip(params, row):
                p.grad = g.clone()
            opt.step()
        assert used == {implementation}
        runs[implementation] = params
    differ = 0
    for p, q in zip(runs["fast"], runs["reference"]):
        assert p.dtype == torch.bfloat16
        ulp = torch.finfo(torch.bfloat16).eps * q.float().abs().clamp_min(1e-3)
        assert ((p.float() - q.float()).abs() <= ulp).all()
        differ += int((p != q).sum())
    total = sum(p.numel() for p in runs["fast"])
    assert differ < total // 100, f"{differ} of {total} weights differ"


@pytest.mark.parametrize("rounding", [False, True], ids=["nearest", "stochastic"])
def test_bf16_weights_step_holds_one_fp32_copy_besides_the_gradient(rounding, monkeypatch):
    """A bf16 matrix's step allocates its fp32 gradient (at the plan, and again at the update)
    and one fp32 working copy of the weight, its update formed in place there: no m x n term
    of the reference path; stochastic rounding's noise comes a chunk at a time."""
    monkeypatch.setattr(precision, "ROUNDING_CHUNK", 1 << 12)
    shape = (256, 512)
    w = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16())
    opt = FiraAdamW([{"params": [w], "rank": 16, "update_proj_gap": 100}], stochastic_rounding=rounding)
    w.grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    opt.step()
    w.grad = torch.randn(shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    fp32 = shape[0] * shape[1] * 4
    assert [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > fp32 // 2] == [fp32] * 3


@pytest.mark.parametrize("dtype,options,wanted", [
    (torch.float32, {}, True),                      # fast path: ||g_i||^2 taken as the step is planned
    (torch.bfloat16, {}, True),                     # fast path on an fp32 working copy
    (torch.float32, {"residual": "sign"}, False),   # FRUGAL: reference path
    (torch.float32, {"residual": "drop"}, False),   # GaLore: no residual
])
def test_gradient_column_norms_are_only_taken_for_the_fast_path(dtype, options, wanted):
    w = torch.nn.Parameter(torch.randn(12, 20, dtype=dtype))
    opt = FiraAdamW([{"params": [w], "rank": 3}], **options)
    w.grad = torch.randn(12, 20, dtype=dtype)
    matrices, _ = opt._plan_step()
    assert (matrices[0][0].grad_sq is not None) == wanted


def test_the_fast_path_runs_adam_through_the_fused_kernel(monkeypatch):
    calls = []
    real = torch._fused_adam_
    monkeypatch.setattr(torch, "_fused_adam_", lambda *a, **kw: calls.append(len(a[0])) or real(*a, **kw))
    params = make_params([(12, 20), (20, 12), (10,)], seed=3)
    opt = FiraAdamW([{"params": params[:2], "rank": 4}, {"params": params[2:]}])
    for row in grad_sequence([(12, 20), (20, 12), (10,)], 2, seed=4):
        for p, g in zip(params, row):
            p.grad = g
        opt.step()
    assert calls == [2, 2]  # both matrices in one call per step; the bias takes torch's AdamW


@pytest.mark.parametrize("implementation", ["fast", "reference"])
def test_the_stats_hook_reports_each_matrix_and_can_be_removed(implementation):
    shapes = [(12, 20), (20, 12), (10,)]
    params = make_params(shapes, seed=5)
    opt = FiraAdamW([{"params": params[:2], "rank": 3, "update_proj_gap": 3}, {"params": params[2:]}],
                    implementation=implementation)
    seen = []
    handle = opt.register_step_stats_hook(lambda optimizer, stats: seen.append(stats))
    rows = grad_sequence(shapes, 8, seed=6)  # the gradients grow 20x at step 5
    for row in rows[:7]:
        for p, g in zip(params, row):
            p.grad = g
        opt.step()
    assert len(seen) == 7 and all([s.param for s in stats] == params[:2] for stats in seen)
    assert all(s.strategy == implementation for stats in seen for s in stats)
    assert all(float(s.limiter_factor) == 1.0 for s in seen[0])  # no history on the first step
    assert all(float(s.limiter_factor) < 1.0 for s in seen[5])  # the limiter binds at the jump
    for s in seen[-1]:  # the history is what was applied: f ||S_t||
        assert torch.equal(opt.state[s.param]["prev_norm"], s.residual_norm * s.limiter_factor)
    handle.remove()
    for p, g in zip(params, rows[7]):
        p.grad = g
    opt.step()
    assert len(seen) == 7
