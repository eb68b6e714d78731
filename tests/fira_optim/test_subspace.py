"""Stage 3, the low-rank direction: its kernels agree, and every base follows its formula."""

import pytest
import torch

import fira_optim.subspace as subspace
from fira_optim import FiraAdamW
from fira_optim.options import Hyper


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
    assert subspace.fused_adam_supported(lows)
    assert not subspace.fused_adam_supported([lows[0].T.contiguous().T])  # not dense row-major
    assert not subspace.fused_adam_supported([lows[0]], [lows[1]])  # R and a state of another shape
    assert not subspace.fused_adam_supported([lows[0]], [lows[0].float() if dtype == torch.float64 else lows[0].double()])
    for step in range(1, 5):
        fused = subspace.low_rank_directions(lows, fused_states, step, hp, fused=True)
        passes = subspace.low_rank_directions(lows, foreach_states, step, hp, fused=False)
        tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-13, atol=1e-15)
        for a, b, s, t in zip(fused, passes, fused_states, foreach_states):
            torch.testing.assert_close(a, b, **tol)
            for key in s:
                torch.testing.assert_close(s[key], t[key], **tol)
        lows = [t * (torch.rand(t.shape, generator=gen, dtype=dtype) * 3 - 1) for t in lows]
    assert bool((fused[0][:, 2] == 0).all())


@pytest.mark.parametrize("base", ["adagrad", "rmsprop"])
def test_adagrad_and_rmsprop_follow_their_formulas(base):
    hp = Hyper.from_group({**FiraAdamW([torch.nn.Parameter(torch.zeros(4, 4))], base=base).param_groups[0],
                           "betas": (0.9, 0.7), "eps": 1e-3})
    gen = torch.Generator().manual_seed(2)
    key = subspace.STATE_KEYS[base][0]
    low = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    state = {key: torch.rand(3, 5, generator=gen, dtype=torch.float64)}
    before = state[key].clone()
    (direction,) = subspace.low_rank_directions([low], [state], 3, hp, fused=True)
    total = before + low**2 if base == "adagrad" else 0.7 * before + 0.3 * low**2
    torch.testing.assert_close(state[key], total, rtol=1e-14, atol=0)
    torch.testing.assert_close(direction, low / (total.sqrt() + 1e-3), rtol=1e-14, atol=0)
