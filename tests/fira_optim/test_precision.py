"""state_dtype (fp32 / bf16 / int8 optimizer states) and stochastic rounding of bf16 weights."""

import copy

import pytest
import torch

from fira_optim import FiraAdamW, precision
from fira_optim.precision import BLOCK, round_into, uniform_bits16

from .common import round_trip

pytest.importorskip("torchao", reason="state_dtype='int8' uses torchao's quantization map")

# Big enough to be quantized (>= 4096 elements, whole blocks of 256): R of the 64 x 256 matrix
# is 16 x 256; the 256-element bias stays fp32 below the threshold, the embedding-like plain
# matrix is quantized.
SHAPES = [(64, 256), (256, 64), (256,), (64, 128)]


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in SHAPES]


def _optimizer(params, **kw):
    return FiraAdamW([{"params": params[:2], "rank": 16, "update_proj_gap": 3},
                      {"params": params[2:]}], lr=1e-2, **kw)


def _grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * (1 + step)).to(dtype) for s in SHAPES]


def _run(params, opt, steps, start=0):
    for k in range(start, start + steps):
        for p, grad in zip(params, _grads(k, params[0].dtype)):
            p.grad = grad
        opt.step()


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_states_are_stored_in_the_chosen_precision(state_dtype):
    params = _params()
    opt = _optimizer(params, state_dtype=state_dtype)
    _run(params, opt, 2)
    wide, tall, bias, plain = (opt.state[p] for p in params)
    if state_dtype == "bfloat16":
        for state in (wide, tall, bias, plain):
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    else:
        for state in (wide, tall, plain):
            assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg"].shape
            assert state["exp_avg_scale"].numel() * BLOCK == state["exp_avg"].numel()
        assert bias["exp_avg"].dtype == torch.float32  # 256 elements: not worth quantizing
    assert wide["basis"].dtype == torch.bfloat16 and wide["prev_norm"].dtype == torch.float32
    fp32 = _optimizer(_params())
    _run(fp32.param_groups[0]["params"] + fp32.param_groups[1]["params"], fp32, 2)
    bytes_of = lambda o: sum(v.numel() * v.element_size() for s in o.state.values() for v in s.values())  # noqa: E731
    assert bytes_of(opt) < (0.55 if state_dtype == "bfloat16" else 0.35) * bytes_of(fp32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_keeps_the_moments_it_does_not_quantize_as_float32_states_do(dtype):
    # the docs said "stay fp32": a bf16 parameter that is not projected keeps bf16 moments, as
    # under state_dtype="float32" (and torchao), so int8 never stores a moment in more bytes
    kept = {}
    for state_dtype in ("float32", "int8"):
        params = _params(dtype)
        opt = _optimizer(params, state_dtype=state_dtype)
        _run(params, opt, 1)
        kept[state_dtype] = [opt.state[p]["exp_avg"].dtype for p in params]
    wide, tall, bias, plain = kept["int8"]
    assert wide == tall == plain == torch.uint8
    # the 256-element bias is not quantized
    assert bias == kept["float32"][2] == (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_low_precision_states_track_fp32_and_resume_exactly(state_dtype):
    ref = _params()
    ref_opt = _optimizer(ref)
    _run(ref, ref_opt, 8)
    params = _params()
    opt = _optimizer(params, state_dtype=state_dtype)
    _run(params, opt, 4)
    saved = round_trip(copy.deepcopy(opt.state_dict()))  # torch.load(weights_only=True)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    _run(params, opt, 4, start=4)
    twin_opt = _optimizer(twin, state_dtype=state_dtype)
    twin_opt.load_state_dict(saved)
    _run(twin, twin_opt, 4, start=4)
    for p, q, r in zip(params, twin, ref):
        assert torch.equal(p, q)  # resumed exactly
        torch.testing.assert_close(p, r, rtol=0.05, atol=0.02)  # and near the fp32 run


def test_a_state_dict_of_another_state_dtype_is_refused():
    params = _params()
    opt = _optimizer(params, state_dtype="int8")
    _run(params, opt, 1)
    with pytest.raises(ValueError, match="state_dtype='int8'"):
        _optimizer(_params()).load_state_dict(opt.state_dict())
    # an unprojected group alone too: loading took int8 moments into an optimizer built for fp32
    embedding = [torch.nn.Parameter(torch.randn(64, 128))]
    int8 = FiraAdamW([{"params": embedding}], lr=1e-2, state_dtype="int8")
    embedding[0].grad = torch.randn(64, 128)
    int8.step()
    fp32 = FiraAdamW([{"params": embedding}], lr=1e-2)
    with pytest.raises(ValueError, match=r"group 0 has state_dtype='float32'; build the optimizer with state_dtype='int8'"):
        fp32.load_state_dict(int8.state_dict())
    assert fp32.param_groups[0]["state_dtype"] == "float32" and not fp32.state
    again = FiraAdamW([{"params": embedding}], lr=1e-2, state_dtype="int8")
    again.load_state_dict(int8.state_dict())  # the same dtype loads
    assert again.state[embedding[0]]["exp_avg"].dtype == int8.state[embedding[0]]["exp_avg"].dtype


def test_invalid_state_dtype_names_the_argument():
    with pytest.raises(ValueError, match="Invalid state_dtype: 'int4'"):
        _optimizer(_params(), state_dtype="int4")


def test_stochastic_rounding_is_unbiased_and_seeded():
    value = torch.full((200_000,), 1.0 + 2**-10)  # between two bf16 neighbours (1 and 1 + 2^-7)
    param = torch.zeros(200_000, dtype=torch.bfloat16)
    round_into(param, value, torch.Generator().manual_seed(0))
    assert set(param.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(param.float().mean().item() - value[0].item()) < 2e-5  # unbiased on average
    nearest = value.to(torch.bfloat16)
    assert torch.equal(nearest, torch.ones_like(nearest))  # round-to-nearest loses the update
    again = torch.zeros_like(param)
    round_into(again, value, torch.Generator().manual_seed(0))
    assert torch.equal(param, again)


def test_uniform_bits16_are_16_fair_bits_drawn_in_order():
    bits = uniform_bits16(400_001, torch.Generator().manual_seed(1))
    assert bits.dtype == torch.int32 and bits.shape == (400_001,)
    assert 0 <= int(bits.min()) and int(bits.max()) < 1 << 16
    # each of the 16 bits set half the time, in each of the four fields of a 64-bit draw (the top
    # bit of a draw too: drawn over the full 64-bit range, not torch's default [0, 2^63))
    fields = bits[:400_000].view(-1, 4)
    for k in range(16):
        share = fields.bitwise_right_shift(k).bitwise_and(1).double().mean(0)
        assert torch.all((share - 0.5).abs() < 0.006), (k, share)
    generator = torch.Generator().manual_seed(1)
    parts = torch.cat([uniform_bits16(n, generator) for n in (4, 1000, 398_996, 1)])
    assert torch.equal(parts, bits)  # lengths that are multiples of 4 continue one draw


def test_bf16_weights_with_stochastic_rounding_resume_exactly():
    params = _params(torch.bfloat16)
    opt = _optimizer(params, stochastic_rounding=True, state_dtype="bfloat16")
    _run(params, opt, 3)
    saved = round_trip(copy.deepcopy(opt.state_dict()))
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    _run(params, opt, 3, start=3)
    twin_opt = _optimizer(twin, stochastic_rounding=True, state_dtype="bfloat16")
    twin_opt.load_state_dict(saved)
    _run(twin, twin_opt, 3, start=3)
    for p, q in zip(params, twin):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)


def test_unprojected_parameters_of_different_groups_round_with_different_bits():
    """Equal bf16 weights with equal gradients, first in two groups (as the Trainer's decay and
    no-decay groups): each rounds with its own stream, as two parameters of one group do."""
    def updated(groups: int) -> list[torch.Tensor]:
        twins = [torch.nn.Parameter(torch.full((4096,), 1.0, dtype=torch.bfloat16)) for _ in range(2)]
        opt = FiraAdamW([{"params": [q]} for q in twins] if groups == 2 else [{"params": twins}], lr=1e-3,
                        stochastic_rounding=True)
        for step in range(3):
            grad = torch.randn(4096, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            for q in twins:
                q.grad = grad.clone()
            opt.step()
        return twins

    for groups in (1, 2):
        a, b = updated(groups)
        assert (a != b).sum() > 1000, groups  # was 0 with two groups: the same bits
    one, two = updated(1), updated(2)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])  # a parameter's stream: its place


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_float64_plain_parameters_are_stepped_in_float64_with_low_precision_states(state_dtype):
    """They went through an fp32 copy and were rounded to fp32 at every step."""
    bias = torch.nn.Parameter(torch.linspace(-1, 1, 4096, dtype=torch.float64) / 3)
    start = bias.detach().clone()
    opt = FiraAdamW([{"params": [bias]}], lr=1e-12, state_dtype=state_dtype)
    bias.grad = torch.ones_like(bias)
    opt.step()
    moved = (bias.detach() - start).abs()
    assert moved.max().item() == pytest.approx(1e-12, rel=1e-3)  # lr * sign-sized first Adam step
    assert not torch.equal(bias.detach(), start.float().double())


def test_gradients_in_another_dtype_than_their_parameter_are_stepped():
    """torch's p.grad_dtype (fp32 gradients of bf16 weights): the projected matrix was updated,
    then torch's step of the bias failed, its step counted and the bias not updated."""
    layer = torch.nn.Linear(32, 32).to(torch.bfloat16)
    start = [p.detach().clone() for p in layer.parameters()]
    for i, p in enumerate(layer.parameters()):
        p.grad_dtype = torch.float32
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
    opt = FiraAdamW(layer.parameters(), rank=4, lr=1e-2)
    opt.step()
    for p, before in zip(layer.parameters(), start):
        assert p.dtype == torch.bfloat16 and (p != before).float().mean() > 0.5
        assert float(opt.state[p]["step"]) == 1.0
    # the bias's step is Adam's first step on its fp32 gradient: -lr * sign(g), rounded to bf16
    expected = (start[1].float() - 1e-2 * torch.sign(layer.bias.grad)).to(torch.bfloat16)
    assert torch.equal(layer.bias.detach(), expected)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.mark.parametrize("states", [{}, {"state_dtype": "bfloat16", "state_rounding": "stochastic"}],
                         ids=["weights", "weights-and-states"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_stochastic_rounding_draws_on_the_parameters_device_and_resumes_exactly(device, states, monkeypatch):
    """A projected matrix and an unprojected vector stepped in chunks, both bf16: every bit is
    drawn by a generator on the parameter's device (a CPU generator for a CUDA parameter costs a
    CPU pass and a host-to-device copy per step), and a resumed run rounds as the whole one; so
    are the bf16 states under state_rounding="stochastic"."""
    from fira_optim import precision

    drawn_on, made = [], precision.rounding_generator

    def recording(*args, **kwargs):
        generator = made(*args, **kwargs)
        drawn_on.append(generator.device.type)
        return generator

    monkeypatch.setattr(precision, "rounding_generator", recording)
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(64, 256, generator=g) * 0.1, torch.randn(precision.CHUNK + 512, generator=g)]

    def build(weights):
        params = [torch.nn.Parameter(w.to(device, torch.bfloat16, copy=True)) for w in weights]
        opt = FiraAdamW([{"params": params[:1], "rank": 16}, {"params": params[1:]}], lr=1e-3,
                        stochastic_rounding=True, **states)
        return params, opt

    def run(params, opt, steps):
        for k in steps:
            grads = torch.Generator().manual_seed(50 + k)
            for p, w in zip(params, init):
                p.grad = torch.randn(w.shape, generator=grads).to(device, torch.bfloat16)
            opt.step()

    params, opt = build(init)
    run(params, opt, range(2))
    saved = round_trip(copy.deepcopy(opt.state_dict()))
    twin, twin_opt = build([p.detach() for p in params])
    run(params, opt, range(2, 4))
    twin_opt.load_state_dict(saved)
    run(twin, twin_opt, range(2, 4))
    for p, q in zip(params, twin):
        assert p.device.type == device and torch.equal(p, q)
    assert drawn_on and set(drawn_on) == {device}
    assert len(drawn_on) == (2 if not states else 6) * 6  # per step: the weights' (and two moments each)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("implementation", ["fast", "reference"])
def test_the_refresh_step_projects_with_the_stored_basis(state_dtype, implementation):
    # A constant gradient of rank 8 plus a little noise: Adam's N = sign(R) at every step, so
    # ||S|| is the same at each. The refresh step projected with the fp32 basis and the next one
    # with its bf16 rounding, whose residual holds a leak of the in-subspace gradient: ||S|| grew
    # on step 2 by more than gamma, and the limiter cut the residual down.
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(64, 8, generator=g) @ torch.randn(8, 256, generator=g) + 1e-3 * torch.randn(64, 256, generator=g)
    p = torch.nn.Parameter(torch.zeros(64, 256))
    opt = FiraAdamW([p], lr=1e-2, rank=8, update_proj_gap=50, state_dtype=state_dtype,
                    implementation=implementation)
    seen = []
    opt.register_step_stats_hook(lambda _opt, stats: seen.append((stats[0].residual_norm, stats[0].limiter_factor)))
    for _ in range(3):
        p.grad = grad.clone()
        opt.step()
    norms = torch.stack([norm for norm, _ in seen])
    torch.testing.assert_close(norms, norms[:1].expand(3), rtol=1e-3, atol=0)
    assert all(float(factor) == 1.0 for _, factor in seen)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_round_into_rounds_a_chunk_at_a_time_with_the_bits_of_one_draw(transposed, monkeypatch):
    """round_into draws its noise ROUNDING_CHUNK elements at a time (a bounded temporary), in the
    tensor's row-major order: the bits, so the weights, of one draw for the whole tensor."""
    value = torch.randn(301, 67, generator=torch.Generator().manual_seed(5)) * 1e-3 + 1.0
    rounded, draw = {}, precision.uniform_bits16
    for chunk in (1 << 30, 1024):
        monkeypatch.setattr(precision, "ROUNDING_CHUNK", chunk)
        sizes = []
        monkeypatch.setattr(precision, "uniform_bits16", lambda n, g: sizes.append(n) or draw(n, g))
        param = torch.zeros(67, 301, dtype=torch.bfloat16).t() if transposed else torch.zeros(301, 67, dtype=torch.bfloat16)
        precision.round_into(param, value.t().contiguous().t() if transposed else value,
                             torch.Generator().manual_seed(6))
        assert max(sizes) == min(chunk, value.numel()) and sum(sizes) == value.numel()
        rounded[chunk] = param
    assert torch.equal(rounded[1024], rounded[1 << 30])
    # stochastic: some values went up, some down, each to a neighbouring bf16 value
    assert ((rounded[1024].float() - value).abs() <= 2 ** -7).all()
    assert (rounded[1024].float() > value).any() and (rounded[1024].float() < value).any()
