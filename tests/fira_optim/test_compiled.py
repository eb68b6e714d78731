"""``implementation="compiled"``: the fused low-rank kernel against the reference path.

Robust to a cold compiler cache on a loaded 2-core machine: the matrices have two shapes, one
per side, so the kernel compiles exactly two static graphs, once for the whole module (the
``compiled_kernel`` fixture, with its own time budget) and in the test process itself (no pool
of compile workers); every test after it reuses them.
"""

import shutil

import pytest
import torch

import fira_optim.compiled as compiled
from fira_optim import VARIANTS, FiraAdamW

SHAPES = [(24, 40), (40, 24), (24, 40)]  # left, right, and a repeated shape: two graphs


def _run(implementation, options, steps=9, weight_decay=0.0):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    bias = torch.nn.Parameter(torch.zeros(5))
    opt = FiraAdamW([{"params": params, "rank": 4}, {"params": [bias]}], lr=0.01,
                    update_proj_gap=4, weight_decay=weight_decay,
                    implementation=implementation, **options)
    for k in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * (1 + 3 * (k == 6))  # a spike at step 6
        bias.grad = torch.randn(5, generator=gen)
        opt.step()
    return [p.detach().clone() for p in [*params, bias]], opt


needs_compiler = pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")),
    reason="torch.compile on the CPU needs a C++ compiler",
)


@pytest.fixture(scope="module")
def compiled_kernel():
    """Compile the kernel's two graphs once, before the tests that compare against it."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):  # no subprocess pool on a small machine
        _run("compiled", {}, steps=2)
    assert compiled._failed is None, compiled._failed


@needs_compiler
@pytest.mark.timeout(900)  # the first test pays for the compilation (about 20 s idle, cold cache)
@pytest.mark.parametrize("variant", ["fira", "galore", "fira-released", "fira-no-limiter",
                                     "fira-no-scaling", "galore-add"])
def test_compiled_matches_reference(variant, compiled_kernel):
    options = VARIANTS[variant]
    ref, _ = _run("reference", options, weight_decay=0.1)
    got, opt = _run("compiled", options, weight_decay=0.1)
    assert compiled._failed is None, compiled._failed  # the kernel ran, not the fallback
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@needs_compiler
@pytest.mark.timeout(900)
def test_compiled_rounds_bf16_states_stochastically_with_the_reference_s_bits(compiled_kernel):
    """state_rounding="stochastic": the kernel updates the decoded fp32 moments, which are then
    written with the same noise as the reference's. The gradients do not depend on the weights,
    so the stored bits are the reference's but where the kernel's fp32 moment, a few ulps off
    (its fused arithmetic), fell on the other side of a rounding boundary: about one rounding in
    65536 per ulp, and then the two differ by one bf16 step."""
    options = {"state_dtype": "bfloat16", "state_rounding": "stochastic"}
    ref, ref_opt = _run("reference", options)
    got, opt = _run("compiled", options)
    assert compiled._failed is None, compiled._failed
    nearest, nearest_opt = _run("compiled", {"state_dtype": "bfloat16"})
    held = [[o.state[p] for g in o.param_groups for p in g["params"]] for o in (ref_opt, opt, nearest_opt)]
    for a, b, *states in zip(ref, got, *held):
        for key in ("exp_avg", "exp_avg_sq"):
            got_state, ref_state = states[1][key], states[0][key]
            assert got_state.dtype == torch.bfloat16, key
            differ = got_state != ref_state
            assert differ.sum() <= 2, (key, int(differ.sum()))
            # one bf16 step at most (2^-7 relative): not another noise's rounding, which differs in
            # about half the entries
            step = (got_state.float() - ref_state.float())[differ].abs() / ref_state.float()[differ].abs()
            assert bool((step <= 2**-7).all()), (key, step)
            assert not torch.equal(states[1][key], states[2][key]), key  # rounded otherwise than to nearest
        # the weights: the kernel's other order of sums in phi and ||S|| (measured up to 5e-6)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_uncovered_settings_fall_back_to_the_fast_path():
    # Matrix-level scaling is not in the kernel: same result as implementation="fast".
    fast, _ = _run("fast", VARIANTS["fira-matrix"])
    comp, _ = _run("compiled", VARIANTS["fira-matrix"])
    for a, b in zip(fast, comp):
        assert torch.equal(a, b)


def test_compiler_failure_falls_back_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled, "_kernel", lambda: broken)
    monkeypatch.setattr(compiled, "_failed", None)
    with pytest.warns(RuntimeWarning, match="compiled.*unavailable.*no C\\+\\+ compiler"):
        got, _ = _run("compiled", {})
    fast, _ = _run("fast", {})
    for a, b in zip(fast, got):
        assert torch.equal(a, b)  # nothing was applied twice or lost


@needs_compiler
@pytest.mark.timeout(900)  # a float64 graph of the kernel to compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_keeps_the_limiter_s_history_in_float64_and_inside_the_subspace(dtype, compiled_kernel):
    """The kernel's write of the new history into a 0-d float64 input was lost (the limiter
    never bound in float64), and its column-norm ||S|| of a gradient inside the subspace was
    round-off of the wrong size: both as the reference now."""
    from tests.fira_optim.common import low_rank_run

    weights, seen, history = low_rank_run("reference", dtype, shape=SHAPES[0], rank=4, batch=2)
    got, got_seen, got_history = low_rank_run("compiled", dtype, shape=SHAPES[0], rank=4, batch=2)
    assert compiled._failed is None, compiled._failed
    assert history > 0 and min(f for _, f in seen) < 1e-3  # the limiter bound after the round-off step
    rtol = 1e-4 if dtype == torch.float32 else 1e-10
    assert got_history == pytest.approx(history, rel=rtol)
    for (norm, factor), (got_norm, got_factor) in zip(seen, got_seen):
        assert got_norm == pytest.approx(norm, rel=rtol) and got_factor == pytest.approx(factor, rel=rtol)
    # float32: the compiled kernel sums in another order, which moves a weight near 0 by a few
    # ulps of the larger ones (2.4e-8 at 2.1e-4 on one CPU): an absolute term of that size
    torch.testing.assert_close(got, weights, rtol=rtol, atol=1e-7 if dtype == torch.float32 else 0)
