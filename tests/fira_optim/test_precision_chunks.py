"""The unprojected parameters stepped through fp32 copies a chunk at a time (low-precision states,
fp16 parameters, stochastic rounding) are bit for bit those stepped whole."""

import pytest
import torch

from fira_optim import FiraAdamW, precision, unprojected

pytest.importorskip("torchao", reason="state_dtype='int8' uses torchao's quantization map")

SMALL_CHUNK = 4 * precision.BLOCK  # 1024 elements
WHOLE = 1 << 40  # no parameter is larger: the unchunked path
# 37 x 256: 9472 elements, quantized, 9 whole chunks and a part; 37 x 100: 3700, not a multiple
# of 256 (fp32 moments under int8), chunked too; 30 x 20: one chunk, stepped whole either way.
SHAPES = [(37, 256), (37, 100), (30, 20)]

VARIANTS = {
    "adamw": {},
    "adagrad": {"base": "adagrad"},
    "rmsprop": {"base": "rmsprop"},
    "released": {"arithmetic": "released"},
    "adamw-foreach": {"foreach": True},
    "adamw-fused": {"fused": True},
}


def _run(chunk, monkeypatch, dtype, steps=3, **options):
    monkeypatch.setattr(precision, "CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in SHAPES]
    opt = FiraAdamW(params, lr=1e-2, rank=None, seed=3, **options)
    counters = {}
    for k in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * (1 + k)).to(dtype)
        opt.step()
        if k == 0:
            counters = {p: opt.state[p]["step"] for p in params}
    for p in params:  # the counter counts steps, and is the tensor the first step made
        assert opt.state[p]["step"] is counters[p] and float(counters[p]) == steps
    return params, opt


def _assert_identical(chunked, whole):
    (params, opt), (ref_params, ref_opt) = chunked, whole
    for p, q in zip(params, ref_params):
        assert p.dtype == q.dtype and torch.equal(p, q)
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert state.keys() == ref_state.keys()
        for key in state:
            assert state[key].dtype == ref_state[key].dtype, key
            assert torch.equal(state[key], ref_state[key]), key


@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16", "float32"])
@pytest.mark.parametrize("dtype,rounding", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.bfloat16, True), (torch.float16, False)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_step_is_bitwise_the_whole_step(variant, weight_decay, dtype, rounding, state_dtype,
                                                 monkeypatch):
    options = dict(VARIANTS[variant], weight_decay=weight_decay, stochastic_rounding=rounding,
                   state_dtype=state_dtype)
    copied = state_dtype != "float32" or dtype == torch.float16 or rounding
    calls = []
    chunked_step = unprojected._step_in_chunks
    monkeypatch.setattr(unprojected, "_step_in_chunks", lambda *a: calls.append(a) or chunked_step(*a))
    chunked = _run(SMALL_CHUNK, monkeypatch, dtype, **options)
    assert len(calls) == (2 * 3 if copied else 0)  # the two large parameters, each step
    calls.clear()
    whole = _run(WHOLE, monkeypatch, dtype, **options)
    assert not calls
    _assert_identical(chunked, whole)


@pytest.mark.parametrize("dtype,rounding", [(torch.float32, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("variant", ["adamw", "released", "rmsprop"])
def test_chunked_step_rounds_bf16_states_stochastically_as_the_whole_step(variant, dtype, rounding, monkeypatch):
    """Each moment draws its own stream, one number per element in order: a chunk at a time (the
    moments' chunks interleaved) draws the bits of the whole."""
    options = dict(VARIANTS[variant], stochastic_rounding=rounding, state_dtype="bfloat16",
                   state_rounding="stochastic")
    chunked = _run(SMALL_CHUNK, monkeypatch, dtype, **options)
    whole = _run(WHOLE, monkeypatch, dtype, **options)
    _assert_identical(chunked, whole)
    nearest = _run(WHOLE, monkeypatch, dtype, **dict(options, state_rounding="nearest"))
    key = "square_avg" if variant == "rmsprop" else "exp_avg_sq"
    assert not torch.equal(whole[1].state[whole[0][0]][key], nearest[1].state[nearest[0][0]][key])


def test_chunks_are_whole_quantization_blocks(monkeypatch):
    monkeypatch.setattr(precision, "CHUNK", 1000)
    (p,) = [torch.nn.Parameter(torch.randn(37, 256))]
    opt = FiraAdamW([p], lr=1e-2, rank=None, state_dtype="int8")
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="multiple of precision.BLOCK"):
        opt.step()


def test_slices_decode_and_encode_as_the_whole_moment():
    g = torch.Generator().manual_seed(1)
    value = torch.randn(40 * precision.BLOCK, generator=g)
    state = precision.moment_zeros(value.shape, precision.StateDtype.INT8, torch.float32, "cpu", "exp_avg")
    whole = dict(state, exp_avg=state["exp_avg"].clone(), exp_avg_scale=state["exp_avg_scale"].clone())
    precision.encode(whole, {"exp_avg": value}, ["exp_avg"])
    for start in range(0, value.numel(), 7 * precision.BLOCK):
        stop = min(start + 7 * precision.BLOCK, value.numel())
        precision.encode_slice(state, {"exp_avg": value[start:stop]}, ["exp_avg"], start, stop)
    assert torch.equal(state["exp_avg"], whole["exp_avg"])
    assert torch.equal(state["exp_avg_scale"], whole["exp_avg_scale"])
    decoded = precision.decode(whole, ["exp_avg"], torch.float32)["exp_avg"]
    part = precision.decode_slice(state, ["exp_avg"], torch.float32, 3 * precision.BLOCK, 9 * precision.BLOCK)
    assert torch.equal(part["exp_avg"], decoded[3 * precision.BLOCK : 9 * precision.BLOCK])


def test_stochastic_rounding_draws_the_same_bits_in_chunks():
    value = torch.randn(10_007) * 1e-3 + 1.0
    whole = torch.zeros(10_007, dtype=torch.bfloat16)
    precision.round_into(whole, value, torch.Generator().manual_seed(4))
    parts = torch.zeros_like(whole)
    generator = torch.Generator().manual_seed(4)
    for start in range(0, 10_007, 1024):
        precision.round_into(parts[start : start + 1024], value[start : start + 1024], generator)
    assert torch.equal(parts, whole)
