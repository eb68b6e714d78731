"""state_rounding="stochastic": the moments written into bf16 states by stochastic rounding."""

import copy
import hashlib

import pytest
import torch

from fira_optim import FiraAdamW, precision
from fira_optim.options import StateRounding, check_options

from .common import round_trip

# a left and a right projection (R of 4 x 40 and 40 x 4), a plain vector and a plain matrix
SHAPES = [(16, 40), (40, 16), (40,), (3, 300)]
STOCHASTIC = {"state_dtype": "bfloat16", "state_rounding": "stochastic"}


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in SHAPES]


def _optimizer(params, **kw):
    return FiraAdamW([{"params": params[:2], "rank": 4, "update_proj_gap": 3},
                      {"params": params[2:]}], lr=1e-2, weight_decay=0.1, seed=5, **kw)


def _run(params, opt, steps, start=0):
    for k in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + k)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * (1 + k)).to(p.dtype)
        opt.step()


def _states(opt, params):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


def _assert_equal(run, other):
    (params, opt), (others, other_opt) = run, other
    for p, q in zip(params, others):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == other_opt.state[q].keys()
        for key, value in opt.state[p].items():
            assert torch.equal(value, other_opt.state[q][key]), key


def test_nearest_is_the_default_and_stochastic_rounds_otherwise():
    runs = {}
    for name, options in (("default", {"state_dtype": "bfloat16"}),
                          ("nearest", {"state_dtype": "bfloat16", "state_rounding": "nearest"}),
                          ("stochastic", STOCHASTIC)):
        params = _params()
        opt = _optimizer(params, **options)
        _run(params, opt, 5)
        runs[name] = params, opt
    _assert_equal(runs["nearest"], runs["default"])
    (params, opt), (near, near_opt) = runs["stochastic"], runs["nearest"]
    assert opt.param_groups[0]["state_rounding"] == "stochastic"
    for p, q in zip(params, near):
        for key in ("exp_avg", "exp_avg_sq"):
            stored, nearest = opt.state[p][key], near_opt.state[q][key]
            assert stored.dtype == torch.bfloat16
            assert (stored != nearest).float().mean() > 0.2, key  # other bits
    for p, q in zip(params[:2], near[:2]):  # the basis is rounded to nearest (from the same gradients)
        assert torch.equal(opt.state[p]["basis"], near_opt.state[q]["basis"])


def test_fast_and_reference_draw_the_same_bits():
    runs = {}
    for implementation in ("fast", "reference"):
        params = _params()
        opt = _optimizer(params, implementation=implementation, **STOCHASTIC)
        _run(params, opt, 7)  # refreshes at steps 0, 3, 6
        runs[implementation] = params, opt
    (fast, fast_opt), (ref, ref_opt) = runs["fast"], runs["reference"]
    for p, q in zip(fast, ref):
        for key in ("exp_avg", "exp_avg_sq"):  # the same fp32 moments (the gradients ignore the weights)
            assert torch.equal(fast_opt.state[p][key], ref_opt.state[q][key]), key
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,rounding", [(torch.float32, False), (torch.bfloat16, True)])
def test_a_resumed_run_rounds_as_the_uninterrupted_one(dtype, rounding):
    params = _params(dtype)
    opt = _optimizer(params, stochastic_rounding=rounding, **STOCHASTIC)
    _run(params, opt, 4)
    saved = round_trip(copy.deepcopy(opt.state_dict()))  # torch.load(weights_only=True)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    _run(params, opt, 4, start=4)
    twin_opt = _optimizer(twin, stochastic_rounding=rounding, **STOCHASTIC)
    twin_opt.load_state_dict(saved)
    _run(twin, twin_opt, 4, start=4)
    _assert_equal((params, opt), (twin, twin_opt))


def test_a_state_dict_saved_before_the_option_loads_with_the_optimizer_s_rounding():
    params = _params()
    opt = _optimizer(params, state_dtype="bfloat16")
    _run(params, opt, 2)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["state_rounding"]
    loaded = _optimizer([torch.nn.Parameter(p.detach().clone()) for p in params], **STOCHASTIC)
    loaded.load_state_dict(saved)
    assert [g["state_rounding"] for g in loaded.param_groups] == ["stochastic", "stochastic"]


def test_invalid_state_rounding_names_the_argument():
    with pytest.raises(ValueError, match=r"Invalid state_rounding: 'up'; expected one of \('nearest', 'stochastic'\)"):
        _optimizer(_params(), state_dtype="bfloat16", state_rounding="up")


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_stochastic_rounding_of_other_than_bf16_states_is_refused_naming_both_arguments(state_dtype):
    message = rf"Invalid state_rounding: 'stochastic' with state_dtype='{state_dtype}'; .* needs state_dtype='bfloat16'"
    with pytest.raises(ValueError, match=message):
        _optimizer(_params(), state_dtype=state_dtype, state_rounding="stochastic")
    with pytest.raises(ValueError, match=message):  # a group's own
        FiraAdamW([{"params": _params()[2:], "state_rounding": "stochastic"}], state_dtype=state_dtype)
    with pytest.raises(ValueError, match=message):  # a config's, before any parameter exists
        check_options(state_dtype=state_dtype, state_rounding="stochastic")
    check_options(state_dtype="bfloat16", state_rounding="stochastic")


def test_state_rounding_may_change_between_steps_but_not_to_stochastic_on_fp32_states():
    params = _params()
    opt = FiraAdamW([{"params": params[:2], "rank": 4}, {"params": params[2:], "state_dtype": "float32"}],
                    lr=1e-2, state_dtype="bfloat16")
    _run(params, opt, 1)
    opt.param_groups[0]["state_rounding"] = "stochastic"  # the same states' layout
    _run(params, opt, 1, start=1)
    before = [p.detach().clone() for p in params]
    opt.param_groups[1]["state_rounding"] = "stochastic"
    with pytest.raises(ValueError, match=r"param_groups\[1\]: Invalid state_rounding: 'stochastic' with "
                                         r"state_dtype='float32'"):
        _run(params, opt, 1, start=2)
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # refused before anything changed


def test_the_states_streams_are_their_own_and_the_weights_are_as_before(monkeypatch):
    def seed(**kw):
        return precision.rounding_generator(3, 7, 11, **kw).initial_seed()

    # the weights' seeds: the linear mix, hashed with a shard's offset (what earlier versions drew)
    linear = (3 * 1_000_003 + 7 * 7919 + 11 * 104_729 + 17) % 2**63
    assert seed() == linear
    shard = int.from_bytes(hashlib.blake2b(f"{linear},5".encode(), digest_size=8).digest(), "little") % 2**63
    assert seed(offset=5) == shard
    state = {"exp_avg": torch.zeros(8, dtype=torch.bfloat16), "exp_avg_sq": torch.zeros(8, dtype=torch.bfloat16)}
    keys = ["exp_avg", "exp_avg_sq"]
    assert precision.state_generators(StateRounding.NEAREST, state, keys, 3, 7, 11) is None
    made = precision.state_generators(StateRounding.STOCHASTIC, state, keys, 3, 7, 11)
    seeds = {made[key].initial_seed() for key in keys}
    assert len(seeds | {linear}) == 3  # neither the weights' stream nor each other's
    # a block of a sharded state (FSDP2's rows) draws its own; fp32 states (int8's small ones) none
    monkeypatch.setattr(precision.distributed, "block_offset", lambda t: (4, 0))
    shifted = precision.state_generators(StateRounding.STOCHASTIC, {**state, "exp_avg_sq": torch.zeros(8)},
                                         keys, 3, 7, 11)
    assert list(shifted) == ["exp_avg"] and shifted["exp_avg"].initial_seed() not in seeds
    assert shifted["exp_avg"].initial_seed() == seed(offset=4, stream="exp_avg")
