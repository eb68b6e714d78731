"""The fused update path against the readable reference path, and what the fused path allocates."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fira_optim.optimizer as optimizer_module
import fira_optim.update as update
from fira_optim import VARIANTS, FiraAdamW
from fira_optim.update import Hyper

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
    real_fast = optimizer_module.apply_fast

    def counting_fast(params, *args, **kwargs):
        calls["fast"] += len(params)  # matrices updated by the (multi-tensor) fast path
        return real_fast(params, *args, **kwargs)

    monkeypatch.setattr(optimizer_module, "apply_fast", counting_fast)
    params, opt = _build(dtype, implementation, variant, stagger, proj_type)
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
    return [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage >= threshold]


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


@pytest.mark.parametrize("dtype,options,wanted", [
    (torch.float32, {}, True),                      # fast path: ||g_i||^2 taken in phase A
    (torch.bfloat16, {}, False),                    # reference path forms S itself
    (torch.float32, {"residual": "sign"}, False),   # FRUGAL: reference path
    (torch.float32, {"residual": "drop"}, False),   # GaLore: no residual
])
def test_gradient_column_norms_are_only_taken_for_the_fast_path(dtype, options, wanted):
    w = torch.nn.Parameter(torch.randn(12, 20, dtype=dtype))
    opt = FiraAdamW([{"params": [w], "rank": 3}], **options)
    w.grad = torch.randn(12, 20, dtype=dtype)
    plans, _ = opt._prepare()
    assert (plans[0].grad_sq is not None) == wanted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("arithmetic", ["paper", "released"])
def test_fused_adam_direction_equals_the_foreach_passes(arithmetic, dtype):
    """torch's fused Adam kernel, run on zero "parameters" with lr = -1 (or -1/b_t for the
    released un-corrected direction) and eps / sqrt(1 - beta2^t), gives N_t and the same
    moments as the foreach passes, over several steps and with an all-zero column."""
    hp = Hyper.from_group({**FiraAdamW([torch.nn.Parameter(torch.zeros(4, 4))],
                                       arithmetic=arithmetic).param_groups[0], "betas": (0.8, 0.95)})
    gen = torch.Generator().manual_seed(9)
    lows = [torch.randn(shape, generator=gen, dtype=dtype) for shape in [(3, 7), (5, 2), (1, 1)]]
    lows[0][:, 2] = 0
    fused_states = [{"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)} for t in lows]
    foreach_states = [{k: v.clone() for k, v in s.items()} for s in fused_states]
    assert update._fused_adam_supported(lows)
    assert not update._fused_adam_supported([lows[0].T.contiguous().T])  # not dense row-major
    assert not update._fused_adam_supported([lows[0]], [lows[1]])  # R and a state of another shape
    assert not update._fused_adam_supported([lows[0]], [lows[0].float() if dtype == torch.float64 else lows[0].double()])
    for step in range(1, 5):
        fused = update._foreach_direction(lows, fused_states, step, hp)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(update, "_fused_adam_supported", lambda *lists: False)
            passes = update._foreach_direction(lows, foreach_states, step, hp)
        tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-13, atol=1e-15)
        for a, b, s, t in zip(fused, passes, fused_states, foreach_states):
            torch.testing.assert_close(a, b, **tol)
            for key in s:
                torch.testing.assert_close(s[key], t[key], **tol)
        lows = [t * (torch.rand(t.shape, generator=gen, dtype=dtype) * 3 - 1) for t in lows]
    assert bool((fused[0][:, 2] == 0).all())


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
