"""The int8 state kernels: nearest-value rounding to the dynamic map (checked against a float64
brute force), agreement with torchao's kernel, the decode error, and state dicts saved by the
torchao-kernel code."""

import os

import pytest
import torch

from fira_optim import FiraAdamW, precision
from fira_optim.options import StateDtype
from fira_optim.precision import BLOCK

quant_utils = pytest.importorskip("torchao.optim.quant_utils", reason="the map is torchao's")

CPU = torch.device("cpu")
SIGNS = [pytest.param(True, id="signed"), pytest.param(False, id="unsigned")]


def _qmap(signed):
    return precision._qmap(signed, CPU)


def _brute_force(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """Code of the map value nearest to each ``x`` in float64; a tie goes to the larger value."""
    m = _qmap(signed).double()
    codes = []
    for part in x.double().split(1 << 14):
        d = (part[:, None] - m[None, :]).abs()
        nearest = d == d.min(1, keepdim=True).values
        # the last (largest) of the nearest values
        codes.append(255 - nearest.flip(1).int().argmax(1))
    return torch.cat(codes).to(torch.uint8)


def _nearest(x: torch.Tensor, signed: bool) -> torch.Tensor:
    lo, mid = precision._tables(signed, x.device)
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    precision._nearest_codes(x.contiguous(), lo, mid, out)
    return out


def _adversarial(signed: bool) -> torch.Tensor:
    """Map values, exact midpoints and their float32 neighbours, +-0, +-1 and their outer
    neighbours, tiny and subnormal values."""
    m = _qmap(signed)
    m64 = m.double()
    mids = (m64[:-1] + m64[1:]) / 2
    down = mids.float()
    up = torch.nextafter(down, torch.full_like(down, float("inf")))
    near = [m, down, up]
    for _ in range(2):
        near += [torch.nextafter(near[-2], torch.full_like(down, -float("inf"))),
                 torch.nextafter(near[-1], torch.full_like(down, float("inf")))]
    tiny = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0000001, -1.0000001, 1.5, -1.5, 1e-45, -1e-45,
                         1e-40, -1e-40, 1.17549435e-38, -1.17549435e-38, 1e-30, 1e-12, -1e-12])
    # the floats at both ends of every 16-bit bucket within [-1.5, 1.5]
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    top = torch.where(top >= 1 << 31, top - (1 << 32), top)
    ends = torch.cat([(top | low).to(torch.int32).view(torch.float32) for low in (0, 0xFFFF)])
    ends = ends[ends.abs() <= 1.5]
    return torch.cat(near + [tiny, ends])


@pytest.mark.parametrize("signed", SIGNS)
def test_codes_are_the_nearest_map_value(signed):
    g = torch.Generator().manual_seed(0)
    n = 1 << 17
    random = torch.cat([
        torch.rand(n, generator=g) * 2 - 1,
        torch.randn(n, generator=g).clamp(-1, 1) * torch.rand(n, generator=g) ** 6,
        (torch.rand(n, generator=g) * 2 - 1).sign() * 10 ** (-12 * torch.rand(n, generator=g)),
    ])
    x = torch.cat([random, _adversarial(signed)])
    if not signed:
        x = torch.cat([x.abs(), x[x < 0]])  # second moments are >= 0; negatives go to 0 anyway
    want, got = _brute_force(x, signed), _nearest(x, signed)
    wrong = (got != want).nonzero().view(-1)
    assert wrong.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in wrong[:5]]
    # and through the block-wise quantizer: blocks holding +-1 have scale 1, x / 1 == x
    blocks = x[: x.numel() // BLOCK * BLOCK].view(-1, BLOCK).clamp(-1, 1).clone()
    blocks[:, 0] = 1.0
    codes, scale = precision._quantize(blocks, signed)
    assert torch.equal(scale, torch.ones_like(scale))
    assert torch.equal(codes.view(-1), _brute_force(blocks.view(-1), signed))


def _as_floats(bits: torch.Tensor) -> torch.Tensor:
    """float32 numbers of the unsigned 32-bit patterns ``bits`` (int64)."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("signed", SIGNS)
def test_the_lookup_rounds_every_float32_as_a_binary_search_does(signed):
    """Every float32 but NaN: in a bucket without a threshold the code is constant, and the
    binary search (count of thresholds <= x) agrees at both ends of each such bucket, so on all
    of it; the buckets that hold a threshold are checked whole (16M floats)."""
    t = precision._thresholds(_qmap(signed))
    lo, mid = precision._tables(signed, CPU)
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    ends = torch.stack([_as_floats(top), _as_floats(top | 0xFFFF)], 1)
    search = torch.searchsorted(t, ends.contiguous().view(-1), right=True).view(-1, 2)
    plain = mid.isnan() & ~ends.isnan().any(1)  # (+-inf: tested with the ties)
    assert torch.equal(search[plain, 0], search[plain, 1])
    assert torch.equal(lo[plain].long(), search[plain, 0])
    low = torch.arange(1 << 16, dtype=torch.int64)
    for buckets in mid.isnan().logical_not().nonzero().view(-1).split(32):
        x = _as_floats((buckets[:, None] << 16 | low).view(-1))
        assert torch.equal(_nearest(x, signed).long(), torch.searchsorted(t, x, right=True))


@pytest.mark.parametrize("signed", SIGNS)
def test_ties_go_to_the_larger_value_and_zero_and_infinities_are_exact(signed):
    m = _qmap(signed).double()
    mids = (m[:-1] + m[1:]) / 2
    exact = mids.float().double() == mids  # the midpoints that are float32 numbers
    assert exact.any()
    codes = _nearest(mids[exact].float(), signed)
    assert torch.equal(codes.long(), exact.nonzero().view(-1) + 1)
    zero = int((_qmap(signed) == 0).nonzero())
    assert _nearest(torch.tensor([0.0, -0.0, 1e-45, -1e-45]), signed).tolist() == [zero] * 4
    assert _nearest(torch.tensor([float("inf"), -float("inf")]), signed).tolist() == [255, 0]


def test_a_map_too_dense_for_the_lookup_is_refused():
    dense = torch.linspace(0.5, 0.5 + 255 * 2**-10, 256)  # neighbours 2^-10 apart near 0.5
    with pytest.raises(ValueError, match="too close"):
        precision._build_tables(dense)


@pytest.mark.parametrize("signed", SIGNS)
def test_the_same_codes_as_torchao_except_at_near_ties(signed):
    """torchao rounds by ``x - m[k] >= (m[k+1] - m[k]) * 0.5`` in float32, which can err within
    an ulp or two of a midpoint; everywhere else the codes are equal, and so are the scales."""
    g = torch.Generator().manual_seed(1)
    n = 1 << 20
    value = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    if not signed:
        value = value.square()
    # plus blocks of scale 1 holding every midpoint and its neighbours
    adv = _adversarial(signed).clamp(-1, 1)
    adv = adv[: adv.numel() // (BLOCK - 1) * (BLOCK - 1)].view(-1, BLOCK - 1)
    adv = torch.cat([torch.ones(adv.shape[0], 1), adv.abs() if not signed else adv], 1).view(-1)
    value = torch.cat([value, adv])
    codes, scale = precision._quantize(value, signed)
    scaled, ao_scale = quant_utils.scale_tensor(value, BLOCK)
    ao_codes = quant_utils.quantize_8bit_with_qmap(scaled, _qmap(signed))
    assert torch.equal(scale, ao_scale)
    differ = (codes != ao_codes).nonzero().view(-1)
    assert (codes[differ].int() - ao_codes[differ].int()).abs().max() <= 1 if differ.numel() else True
    x = scaled[differ].double()
    m = _qmap(signed).double()
    mid = (m[torch.minimum(codes[differ], ao_codes[differ]).long()]
           + m[torch.maximum(codes[differ], ao_codes[differ]).long()]) / 2
    ulp = (torch.nextafter(scaled[differ], torch.full_like(scaled[differ], 2.0)) - scaled[differ]).double()
    assert ((x - mid).abs() <= 2 * ulp).all()  # only at near-ties
    assert torch.equal(codes[differ], _brute_force(scaled[differ], signed))  # and ours are right
    assert differ.numel() < 1e-3 * value.numel()


@pytest.mark.parametrize("signed", SIGNS)
def test_decode_of_encode_is_the_nearest_map_value_times_the_scale(signed):
    g = torch.Generator().manual_seed(2)
    n = 1 << 16
    value = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4 * 3
    value[:BLOCK] = 0.0  # an all-zero block: scale 1e-12, decodes to zeros
    if not signed:
        value = value.square()
    codes, scale = precision._quantize(value, signed)
    back = precision._dequantize(codes, scale, signed)
    blocks = value.view(-1, BLOCK)
    absmax = blocks.abs().amax(1, keepdim=True)
    assert torch.equal(scale, absmax.view(-1).clamp(min=1e-12))
    nearest = _brute_force((blocks / scale[:, None]).view(-1), signed)
    assert torch.equal(back, (_qmap(signed)[nearest.long()].view(-1, BLOCK) * scale[:, None]).view(-1))
    assert torch.equal(back[:BLOCK], torch.zeros(BLOCK))
    # the largest gap between neighbouring map values is 0.9 / 64 (signed) or 0.9 / 128
    # (unsigned); within a block the error is at most half of it, relative to the absmax, or
    # -1 - m[0] for a signed block whose absmax is negative (the signed map ends at -0.9930)
    m = _qmap(signed).double()
    bound = max(((m[1:] - m[:-1]).max() / 2).item(), (1 + m[0]).abs().item() if signed else 0.0)
    err = (back.view(-1, BLOCK) - blocks).double().abs() / absmax.double().clamp(min=1e-30)
    assert err.max().item() <= bound + 2**-23  # + the rounding of code value * scale
    assert bound < (0.0071 if signed else 0.0036)
    _assert_encoding_the_decoded_values_gives_the_codes_back(codes, scale, signed)


def _assert_encoding_the_decoded_values_gives_the_codes_back(codes, scale, signed):
    """Where the block's scale survives: always for the unsigned map (its absmax element codes
    to 1.0), and for a signed block unless its absmax element is negative (the signed map ends
    at -0.9930, so that block's absmax shrinks and all its codes may move)."""
    back = precision._dequantize(codes, scale, signed)
    again, again_scale = precision._quantize(back, signed)
    kept = again_scale == scale
    assert kept.all() or signed
    assert (codes.view(-1, BLOCK)[~kept] != 255).all()  # no +1.0 in a block that lost its scale
    assert torch.equal(again.view(-1, BLOCK)[kept], codes.view(-1, BLOCK)[kept])
    assert kept.float().mean() > 0.3


def test_encode_writes_the_stored_codes_in_place():
    g = torch.Generator().manual_seed(3)
    state = precision.moment_zeros((64, 128), StateDtype.INT8, torch.float32, CPU, "exp_avg")
    stored, stored_scale = state["exp_avg"], state["exp_avg_scale"]
    working = precision.decode(state, ["exp_avg"], torch.float32)
    working["exp_avg"] = torch.randn(64, 128, generator=g)
    precision.encode(state, working, ["exp_avg"])
    assert state["exp_avg"] is stored and state["exp_avg_scale"] is stored_scale
    codes, scale = precision._quantize(working["exp_avg"], True)
    assert torch.equal(stored, codes) and torch.equal(stored_scale, scale)


def _saved_int8():
    path = os.path.join(os.path.dirname(__file__), "data", "saved_state_int8.pt")
    return torch.load(path, weights_only=True)


def test_a_state_dict_saved_by_the_torchao_kernel_with_value_coded_second_moments_loads():
    """``data/saved_state_int8.pt`` was written with torchao's quantize kernel
    (``data/make_saved_int8_state.py``), when second moments were coded as values: today's code
    decodes its first moments to the same fp32 values bit for bit, and its second moments to
    those values coded again as square roots (one more rounding); encoding gives the same codes
    back (where the scale survives), and it continues."""
    saved = _saved_int8()
    keys = ("exp_avg", "exp_avg_sq")
    g = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in [(64, 256), (64, 128)]]
    opt = FiraAdamW([{"params": params[:1], "rank": 16, "update_proj_gap": 3},
                     {"params": params[1:]}], lr=1e-2, state_dtype="int8")
    assert all("exp_avg_sq_scale" in s for s in saved["optimizer"]["state"].values())  # the old coding
    opt.load_state_dict(saved["optimizer"])
    for p, want in zip(params, saved["decoded"]):
        state = opt.state[p]
        assert "exp_avg_sq_scale" not in state
        working = precision.decode(state, keys, torch.float32)
        codes, scale = precision._quantize(want["exp_avg_sq"].sqrt(), signed=False)
        expected = {"exp_avg": want["exp_avg"],
                    "exp_avg_sq": precision._dequantize(codes, scale, signed=False).square().view_as(want["exp_avg_sq"])}
        for key in keys:
            assert state[key].dtype == torch.uint8
            assert torch.equal(working[key], expected[key])
            _assert_encoding_the_decoded_values_gives_the_codes_back(
                state[key], state[precision._scale_key(key)], precision.SIGNED[key])
        torch.testing.assert_close(working["exp_avg_sq"], want["exp_avg_sq"], rtol=0.02,
                                   atol=0.01 * want["exp_avg_sq"].max().item())
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("signed", SIGNS)
def test_cuda_codes_equal_cpu_codes(signed):
    g = torch.Generator().manual_seed(5)
    value = torch.randn(1 << 18, generator=g) * torch.rand(1 << 18, generator=g) ** 4
    value = torch.cat([value if signed else value.square(), _adversarial(signed)[: 1 << 16].clamp(-1, 1)])
    value = value[: value.numel() // BLOCK * BLOCK]
    codes, scale = precision._quantize(value, signed)
    cuda_codes, cuda_scale = precision._quantize(value.cuda(), signed)
    assert torch.equal(cuda_codes.cpu(), codes) and torch.equal(cuda_scale.cpu(), scale)
    assert torch.equal(precision._dequantize(cuda_codes, cuda_scale, signed).cpu(),
                       precision._dequantize(codes, scale, signed))


def test_a_row_whose_gradient_stops_is_not_thrown_by_a_second_moment_rounded_to_zero():
    """Rows of one block with gradients 1 and 1e-4, then the second row's gradient stops (an
    embedding row of a token absent from the batch). Coded as a value, its v (1e-8 of the
    block's largest) rounded to 0 while its m (1e-4) did not: m / (0 + eps) moved the row by
    about 1e3 x lr (the blow-up of the ``micro`` embeddings). Coded as a square root, the row
    moves as with fp32 states."""
    moved = {}
    for state_dtype in ("float32", "int8"):
        param = torch.nn.Parameter(torch.zeros(64, 64))  # 4096 elements: quantized, 4 rows a block
        opt = FiraAdamW([{"params": [param]}], lr=1e-3, state_dtype=state_dtype)
        for step in range(3):
            grad = torch.zeros(64, 64)
            grad[0] = 1.0
            if step == 0:
                grad[1] = 1e-4
            param.grad = grad
            opt.step()
        moved[state_dtype] = param.detach()[1].clone()
    assert moved["float32"].abs().max() < 3e-3  # about lr per step
    torch.testing.assert_close(moved["int8"], moved["float32"], rtol=0.05, atol=0)


def test_a_gradient_spike_rounds_the_moments_of_its_block_mates_to_zero():
    """What the docs say of one block's shared scale: an entry 1e15 times its block-mates' sets
    the scale, and their moments, below the map's smallest step of it, decode as 0 (fp32 states
    keep them); the other blocks keep theirs. Block-wise absmax coding does this by design."""
    kept = {}
    for state_dtype in ("float32", "int8"):
        param = torch.nn.Parameter(torch.zeros(64, 64))  # 4 rows a block of 256
        opt = FiraAdamW([{"params": [param]}], state_dtype=state_dtype)
        grad = torch.ones(64, 64)
        grad[0, 0] = 1e15
        param.grad = grad
        opt.step()
        kept[state_dtype] = precision.decode(opt.state[param], ("exp_avg", "exp_avg_sq"), torch.float32)
    for key in ("exp_avg", "exp_avg_sq"):
        fp32, int8 = kept["float32"][key], kept["int8"][key]
        assert (fp32[1:4] > 0).all()  # the block-mates of the spike, in fp32
        assert (int8[0, 1:] == 0).all() and (int8[1:4] == 0).all()
        torch.testing.assert_close(int8[4:], fp32[4:], rtol=0.02, atol=0)  # the other blocks
        torch.testing.assert_close(int8[0, 0], fp32[0, 0], rtol=0.02, atol=0)
