r"""The precision of optimizer states (``state_dtype``) and stochastic rounding of bf16 weights.

``state_dtype="float32"`` (default) keeps every state in the working dtype, at least fp32.
``"bfloat16"`` stores the moments (low-rank and unprojected) and the basis in bf16.
``"int8"`` stores each moment block-wise quantized: 8-bit codes of the dynamic (tree)
quantization map of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (2022), one
fp32 absmax scale per block of 256 elements, as bitsandbytes and torchao do; the basis is bf16
(an orthonormal basis does not survive 8 bits). Moments of fewer than 4096 elements, or not a
multiple of 256, stay as ``"float32"`` keeps them (torchao's rule: their bytes do not matter): fp32,
but in the dtype of a bf16 (or fp64) parameter that is not projected, as ``torch.optim.AdamW``'s
and torchao's are. The limiter's :math:`\|S_{t-1}\|` and the step counters stay fp32.

Every step decodes a matrix's states to fp32, runs the stages on them, and encodes them back, so
the arithmetic is the fp32 arithmetic on rounded states. Bytes per element of a moment: 4, 2,
or 1 + 4/256.

The quantization map is torchao's (``torchao.optim.quant_utils.create_dynamic_map``, the same
256 values as bitsandbytes'; ``pip install torchao``, needed for ``"int8"`` only). The kernels
are this module's, plain torch ops (CPU and CUDA), because the libraries' were measured too slow
or inexact (``python benchmarks/int8_quantize.py --out docs/benchmarks/int8_quantize.json``,
2026-11-29, one run on the project's 2-core CPU under a load average of 4, torch on one thread,
median time per element of a block-wise quantize with its scales; tensors of 64K to 4M elements
on both maps, normal values on the signed one and four decades of positive values on the
unsigned one; at 4096 elements the dozen op calls dominate: 8-13 ns here, 65-66 torchao):

- torchao's ``quantize_8bit_with_qmap`` (an 8-round binary search with gathers on int64 codes)
  takes 49-238 ns per element: at ``tiny``'s 8M moment elements (embedding and head), 0.4-1.9 s
  per pass over them, beside a step of about 2 s.
- bitsandbytes 0.50.2 ``quantize_blockwise`` on the CPU takes 6.9-14 ns per element with its
  own threads, and is not exact: 11.8-12.9% of the codes on the unsigned map differ from the
  nearest map value, by up to 7 codes (0.15% on the signed map, by up to 4).
- Here: a lookup table indexed by the top 16 bits of the scaled float32 (sign, exponent and 7
  mantissa bits: 65536 buckets), giving the bucket's lowest code and the one rounding threshold
  inside it (:func:`_build_tables` checks that no bucket holds two), so the code is
  ``lo[b] + (x >= mid[b])``: 1.7-3.8 ns per element, 26-62 times faster than torchao's, and every
  code the nearest (the script checks each against a float64 search of the map). Decoding
  gathers the map with int32 indices (``index_select``): 0.6-1.6 ns per element, torchao's
  1.7-17 (bitsandbytes' 0.3-0.7, threaded).

The codes are the nearest map value's, exactly (ties go to the larger value; tested for every
float32 but NaN), and the scales are torchao's, bit for bit: codes written by torchao's kernel
decode to the same values, and differ from these only within an ulp or two of a midpoint (its
rounding test is computed in float32). What is coded differs for the second moments, stored
here as square roots (:data:`ROOT`). torchao's ``OptimState8bit`` tensor
subclass is not used: a state dict of plain ``uint8`` codes and ``float32`` scales loads with
``torch.load(weights_only=True)`` without allow-listing a class, and stays readable without
torchao.

Stochastic rounding (``stochastic_rounding=True``) writes an update formed in fp32 into a bf16
parameter by rounding up or down with probabilities proportional to the distances, so small
updates are not lost to round-to-nearest on average. The random bits come from a generator
seeded by the optimizer's ``seed``, the parameter (a projected matrix's index, a plain
parameter's place among all groups'), the step and, for a shard of a DTensor parameter (FSDP2),
where its block starts, so a resumed run rounds as the uninterrupted one did. The generator
lives on the parameter's device (CUDA's Philox for a CUDA parameter), so a CUDA run draws other
bits than a CPU run with the same seed.

``state_rounding="stochastic"`` (bf16 states only) writes the moments by the same arithmetic
(:func:`encode` and :func:`encode_slice` with the generators of :func:`state_generators`): rounded
to nearest, a change to Adam's ``v`` below half a bf16 step is lost, and at ``beta2 = 0.999``
every decay is. Each moment of each parameter draws from its own stream: the parameter's seed
(``seed``, its place, the step count before the update) with the offset of the moment's own
block under FSDP2, hashed with the moment's name, so it resumes exactly and draws other bits
than the weights. 16 random bits per element and step (:func:`uniform_bits16`). The basis is
rounded to nearest.
"""

from __future__ import annotations

import functools
import hashlib
import logging

import torch

from . import distributed
from .options import StateDtype, StateRounding

#: Elements per quantization block, and the fewest elements a quantized moment has.
BLOCK = 256
MIN_QUANTIZED = 4096

#: Moment keys of every base, and whether their values can be negative (signed map).
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "sum": False, "square_avg": False}
#: The second moments (sums of squares): stored in int8 as their square roots. Their values
#: span the square of the first moment's range, and the map's smallest step (3.3e-7 of a block's
#: largest value) turned a row's v to 0 while its m stayed: Adam's m / (sqrt(v) + eps) then
#: threw the embedding rows of rarely seen tokens (``benchmarks/int8_embedding_rows.py``:
#: largest entry 185.6 after 10 steps, 0.13 with fp32 states).
ROOT = frozenset(key for key, signed in SIGNED.items() if not signed)


def _scale_key(key: str) -> str:
    # the scale's name tells the coding: a root-coded moment's differs from the value-coded
    # one of earlier versions (converted on load: fira_optim.loading.upgraded)
    return f"{key}_root_scale" if key in ROOT else f"{key}_scale"


def value_coded(entry: dict) -> list[str]:
    """The second moments of a saved state ``entry`` coded as values (by versions before
    :data:`ROOT`): their scales carry the old name."""
    return [key for key in ROOT if f"{key}_scale" in entry and getattr(entry.get(key), "dtype", None) == torch.uint8]


def root_coded(entry: dict) -> dict:
    """``entry`` with its value-coded second moments (:func:`value_coded`) coded as square roots:
    decoded, square-rooted and encoded again (one more rounding of each)."""
    entry = dict(entry)
    for key in value_coded(entry):
        codes = entry[key]
        value = _dequantize(codes, entry.pop(f"{key}_scale"), signed=False)
        entry[key], entry[_scale_key(key)] = _quantize(value.sqrt(), signed=False)
        entry[key] = entry[key].view(codes.shape)
    return entry


def _decode_moment(key: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Moment ``key`` from its codes: the map values times the scales, squared for :data:`ROOT`."""
    value = _dequantize(codes, scale, SIGNED[key])
    return value.square_() if key in ROOT else value


def _encode_moment(key: str, value: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Moment ``key`` into ``codes`` and ``scale`` in place (its square root for :data:`ROOT`)."""
    _quantize_into(value.sqrt() if key in ROOT else value, codes, scale, SIGNED[key])


def quantized(numel: int) -> bool:
    return numel >= MIN_QUANTIZED and numel % BLOCK == 0


def moment_zeros(shape, kind: StateDtype, work_dtype: torch.dtype, device, key: str,
                 make=None) -> dict[str, torch.Tensor]:
    """The stored form of a zero moment ``key`` of ``shape``: ``{key: ...}`` plus, for int8,
    ``{_scale_key(key): ...}`` (``key_scale``, or ``key_root_scale`` for a second moment).
    ``make(shape, dtype)`` builds a tensor (default ``torch.zeros``)."""
    make = make or (lambda s, dtype: torch.zeros(s, dtype=dtype, device=device))
    numel = 1
    for d in shape:
        numel *= d
    if kind is StateDtype.BFLOAT16:
        return {key: make(shape, torch.bfloat16)}
    if kind is StateDtype.INT8 and quantized(numel):
        return {key: make(shape, torch.uint8), _scale_key(key): make((numel // BLOCK,), torch.float32)}
    return {key: make(shape, work_dtype)}


def basis_dtype(kind: StateDtype, work_dtype: torch.dtype) -> torch.dtype:
    return work_dtype if kind is StateDtype.FLOAT32 else torch.bfloat16


def decode(state: dict, keys, work_dtype: torch.dtype) -> dict:
    """A copy of ``state`` whose moments ``keys`` are ``work_dtype`` tensors. The
    stored tensors are untouched until :func:`encode`."""
    working = dict(state)
    for key in keys:
        stored = state[key]
        if stored.dtype == torch.uint8:
            codes = stored
            working[key] = _decode_moment(key, codes, state[_scale_key(key)]).to(work_dtype)
        elif stored.dtype != work_dtype:
            working[key] = stored.to(work_dtype)
    return working


def encode(state: dict, working: dict, keys, generators: dict | None = None) -> None:
    """Write the updated moments of ``working`` back into their stored form in ``state``; a bf16
    moment by stochastic rounding where ``generators`` (:func:`state_generators`) holds its key."""
    for key in keys:
        stored, value = state[key], working[key]
        if value is stored:
            continue
        if stored.dtype == torch.uint8 and stored.is_contiguous():
            _encode_moment(key, value, stored, state[_scale_key(key)])
        elif stored.dtype == torch.uint8:
            codes = torch.empty(stored.shape, dtype=torch.uint8, device=stored.device)
            _encode_moment(key, value, codes, state[_scale_key(key)])
            stored.copy_(codes)
        else:
            _write(stored, value, key, generators)


def decode_slice(state: dict, keys, work_dtype: torch.dtype, start: int, stop: int) -> dict:
    """The elements ``start:stop`` (in memory order) of the moments ``keys`` of ``state``, as
    flat ``work_dtype`` tensors: views of the stored tensors where these are ``work_dtype``
    (updated in place), else decoded copies. For a quantized moment, ``start`` and ``stop``
    (unless it is the end) are multiples of :data:`BLOCK`. The stored tensors are contiguous."""
    working = {}
    for key in keys:
        stored = state[key].view(-1)
        if stored.dtype == torch.uint8:
            codes = stored[start:stop]
            scale = state[_scale_key(key)][start // BLOCK : stop // BLOCK]
            working[key] = _decode_moment(key, codes, scale).to(work_dtype)
        else:
            working[key] = stored[start:stop].to(work_dtype)
    return working


def encode_slice(state: dict, working: dict, keys, start: int, stop: int,
                 generators: dict | None = None) -> None:
    """Write the updated moments of ``working`` (from :func:`decode_slice`) back into the elements
    ``start:stop`` of their stored form in ``state``; a quantized moment's codes and the scales
    of its blocks ``start // BLOCK`` to ``stop // BLOCK``, in place; a bf16 moment by stochastic
    rounding where ``generators`` holds its key (each draws its noise in order, 16 bits per
    element, so on the CPU consecutive slices whose lengths are multiples of 4 draw the whole
    moment's bits)."""
    for key in keys:
        stored, value = state[key].view(-1)[start:stop], working[key]
        if value.dtype == stored.dtype and value.data_ptr() == stored.data_ptr():
            continue  # a view of the stored moment, updated in place
        if stored.dtype == torch.uint8:
            scale = state[_scale_key(key)][start // BLOCK : stop // BLOCK]
            _encode_moment(key, value, stored, scale)
        else:
            _write(stored, value, key, generators)


def _write(stored: torch.Tensor, value: torch.Tensor, key: str, generators: dict | None) -> None:
    """``stored.copy_(value)``, or by stochastic rounding (:func:`round_into`) with the generator
    of ``key`` in ``generators``; a DTensor's local block (noise of its own shape)."""
    generator = generators.get(key) if generators else None
    if generator is None:
        stored.copy_(value)
    else:
        round_into(distributed.to_local(stored), distributed.to_local(value), generator)


def _quantization():
    # torchao logs a warning for each optional C++/CUDA kernel library it cannot load; the
    # quantization used here is plain torch, so those lines would only alarm users.
    # torch's pytree also warns about an enum that torchao registers.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.optim import quant_utils
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("state_dtype='int8' needs torchao (pip install torchao)") from err
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return quant_utils


def require_int8() -> None:
    """Raise a clear ImportError now if int8 states cannot work here."""
    _quantization()


@functools.lru_cache(maxsize=8)
def _qmap(signed: bool, device: torch.device) -> torch.Tensor:
    q = _quantization()
    return torch.tensor(q.create_dynamic_map(signed=signed), dtype=torch.float32, device=device)


def _thresholds(qmap: torch.Tensor) -> torch.Tensor:
    """The 255 rounding thresholds of the sorted map ``qmap``: the smallest float32 at or above
    each exact midpoint of two neighbours, so that for every float32 ``x``, ``x >= t[k]`` iff
    ``x`` is at least as close to ``qmap[k + 1]`` as to ``qmap[k]`` (ties go up)."""
    m = qmap.double()
    mids = (m[:-1] + m[1:]) / 2  # exact: the sum of two float32 fits in a float64
    t = mids.float()
    return torch.where(t.double() < mids, torch.nextafter(t, torch.full_like(t, float("inf"))), t)


@functools.lru_cache(maxsize=8)
def _tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    lo, mid = _build_tables(_qmap(signed, torch.device("cpu")))
    return lo.to(device), mid.to(device)


def _build_tables(qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's lookup tables for the sorted float32 map ``qmap`` (256 values), indexed
    by the top 16 bits of a float32 (sign, exponent, 7 mantissa bits; bucket ``b`` holds the
    floats whose bit pattern is ``b << 16`` to ``b << 16 | 0xFFFF``): ``lo`` (uint8), the code of
    the bucket's lowest value, and ``mid`` (float32), the one rounding threshold inside the bucket
    (NaN where there is none), so that the code of ``x`` is ``lo[b] + (x >= mid[b])``. Built in
    float64; raises if a bucket holds two thresholds. A bucket is 2^-8 to 2^-7 of its values
    wide; the dynamic maps' thresholds are at least 1.35 bucket widths apart (unsigned map, near
    1; 2.7 for the signed map). Exact for every float32 but NaN (checked over all 2^32 bit patterns
    against a binary search); NaNs get the code of 0.0 or of +-inf (their block's scale is NaN)."""
    t = _thresholds(qmap).double()
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    top = torch.where(top >= 1 << 31, top - (1 << 32), top)  # as int32 bit patterns
    first, last = [(top | low).to(torch.int32).view(torch.float32).double() for low in (0, 0xFFFF)]
    # Exponent 255: +-inf (low bits 0) shares its bucket with NaNs; buckets of NaNs only count
    # as 0.0
    first = torch.where(first.isnan(), last, first).nan_to_num(0.0, float("inf"), -float("inf"))
    last = torch.where(last.isnan(), first, last)
    lowest, highest = torch.minimum(first, last), torch.maximum(first, last)
    below = torch.searchsorted(t, lowest, right=True)  # thresholds <= the bucket's lowest value
    inside = torch.searchsorted(t, highest, right=True) - below
    if int(inside.max()) > 1:
        raise ValueError("int8 quantization map: its values are too close for the 16-bit lookup "
                         "(a bucket holds two rounding thresholds)")
    one = inside == 1
    mid = torch.full((1 << 16,), float("nan"), dtype=torch.float32)
    mid[one] = t[below[one]].float()
    return below.to(torch.uint8), mid


#: Elements quantized or dequantized at a time (whole blocks): bounds the temporaries of a large
#: moment (an embedding's) to about :data:`CHUNK_TEMPORARY_BYTES` per element of a chunk (13 MB)
#: instead of several times the moment.
CHUNK = 1 << 20
#: Bytes of fp32 copies per element of a chunk stepped through low precision (the parameter, its
#: gradient and two moments decoded, and the update).
CHUNK_TEMPORARY_BYTES = 13


def _quantize_into(value: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> None:
    """Write the codes of ``value`` (nearest map value, block-wise absmax scaled) into ``codes``
    and its block scales into ``scale``, in place."""
    lo, mid = _tables(signed, value.device)
    flat, out = value.reshape(-1), codes.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        stop = min(start + CHUNK, flat.numel())
        blocks = flat[start:stop].float().view(-1, BLOCK)
        part_scale = scale[start // BLOCK : stop // BLOCK]
        # torchao's scale_tensor, exactly: the same scales and scaled values
        torch.amax(blocks.abs(), -1, out=part_scale)
        part_scale.clamp_(min=1e-12)
        _nearest_codes((blocks / part_scale[:, None]).view(-1), lo, mid, out[start:stop])


def _nearest_codes(x: torch.Tensor, lo: torch.Tensor, mid: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (uint8) = the code of the map value nearest to each float32 of ``x`` (1-D)."""
    bucket = x.view(torch.int32).bitwise_right_shift(16).bitwise_and_(0xFFFF)
    torch.index_select(lo, 0, bucket, out=out)
    out.add_(x >= mid.index_select(0, bucket))


def _quantize(value: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(value.shape, dtype=torch.uint8, device=value.device)
    scale = torch.empty(value.numel() // BLOCK, dtype=torch.float32, device=value.device)
    _quantize_into(value, codes, scale, signed)
    return codes, scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    qmap = _qmap(signed, codes.device)
    flat = codes.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.float32, device=codes.device)
    for start in range(0, flat.numel(), CHUNK):
        stop = min(start + CHUNK, flat.numel())
        part = out[start:stop]
        torch.index_select(qmap, 0, flat[start:stop].int(), out=part)
        part.view(-1, BLOCK).mul_(scale[start // BLOCK : stop // BLOCK, None])
    return out.view(codes.shape)


def uniform_bits16(numel: int, generator: torch.Generator) -> torch.Tensor:
    """``numel`` random integers uniform in ``[0, 65536)`` (int32), drawn on ``generator``'s
    device: the four 16-bit fields of each of ``ceil(numel / 4)`` 64-bit draws, in order, so
    consecutive calls whose lengths are multiples of 4 draw what one call of their total length
    draws (on the CPU). What costs is the number of draws, not their width: one ``torch.randint``
    per element made stochastic rounding of a plain parameter's two bf16 moments the larger part
    of its step on the CPU (``benchmarks/bf16_state_rounding.py`` times it)."""
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=generator.device)
    words.random_(-(2**63), None, generator=generator)  # the full 64-bit range: every bit random
    return words.view(torch.int16)[:numel].to(torch.int32).bitwise_and_(0xFFFF)


#: Elements rounded stochastically at a time: bounds the noise (4 bytes per element, 6 while it
#: is drawn) to a chunk instead of the whole matrix. On an accelerator a chunk is 16 times as
#: large, so that a 7B model's step adds a few hundred kernel launches, not thousands.
ROUNDING_CHUNK = CHUNK
ROUNDING_CHUNK_ACCELERATOR = CHUNK << 4


def round_into(param: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None) -> None:
    """``param.copy_(value)``, by stochastic rounding where ``generator`` is given and ``param``
    is bf16: the 16 low bits of each fp32 value get uniform noise (:func:`uniform_bits16`)
    before they are cut off. In chunks of :data:`ROUNDING_CHUNK` elements (multiples of 4 in
    memory order): on the CPU the bits are those of one draw for the whole tensor."""
    if generator is None or param.dtype != torch.bfloat16:
        param.copy_(value)
        return
    if not (param.is_contiguous() and value.is_contiguous()):
        # a transposed weight: a contiguous copy rounded, then copied in (rare: its own order)
        rounded = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        round_into(rounded, value.contiguous(), generator)
        param.copy_(rounded)
        return
    size = ROUNDING_CHUNK if param.device.type == "cpu" else ROUNDING_CHUNK_ACCELERATOR
    flat, source = param.view(-1), value.view(-1)
    for start in range(0, flat.numel(), size):
        part = source[start : start + size]
        bits = part.float().view(torch.int32)  # a view where value is fp32
        # Drawn where the generator lives (the parameter's device, see rounding_generator): bits
        # drawn on the CPU for a CUDA parameter cost a CPU pass and a host-to-device copy of 4
        # bytes per element; at 7B the CPU draws alone took 28 s per step (2 threads, 240M
        # draws/s, one draw per element then; a third of that now, uniform_bits16).
        noise = uniform_bits16(bits.numel(), generator).to(bits.device)
        # in place on the noise: one temporary of 4 bytes per element, not two
        rounded = noise.add_(bits).bitwise_and_(-65536).view(torch.float32)
        flat[start : start + size].copy_(rounded)  # exact: the low 16 bits are zero


def rounding_generator(seed: int, order: int, step: int, device: torch.device | str = "cpu",
                       offset: int | tuple[int, ...] = 0, stream: str = "") -> torch.Generator:
    """The generator of one matrix's stochastic rounding at one step (resume-exact), on
    ``device``, the parameter's: the CPU's Mersenne twister or CUDA's Philox, so the same seed
    draws different bits on the two, and each resumes exactly. ``offset``: where this process's
    block of a sharded parameter starts: its first row for FSDP2's row shards, the whole offset
    for another placement (:func:`shard_offset`). Each shard draws from the start of its stream,
    so without it every shard rounded with the same bits; the block starting at row 0 (and an
    unsharded parameter, and every replica) keeps the stream it always had. ``stream``: what is
    rounded when it is not the parameter itself, the name of an optimizer state
    (:func:`state_generators`): hashed into the seed with the offset, so a state's stream is
    neither its parameter's nor another state's."""
    seed = (seed * 1_000_003 + order * 7919 + step * 104_729 + 17) % (2**63)
    if offset or stream:
        # without a stream, the text (so the seed) of a parameter's shard is what it always was
        text = f"{seed},{offset}" + (f",{stream}" if stream else "")
        mixed = hashlib.blake2b(text.encode(), digest_size=8).digest()
        seed = int.from_bytes(mixed, "little") % (2**63)
    return torch.Generator(device=device).manual_seed(seed)


def shard_offset(tensor: torch.Tensor) -> int | tuple[int, ...]:
    """:func:`rounding_generator`'s ``offset`` of this process's block of ``tensor``: 0 for a
    plain tensor and a replica, the first row of a row shard, the whole offset otherwise."""
    offset = distributed.block_offset(tensor)
    return 0 if not any(offset) else offset[0] if not any(offset[1:]) else offset


def state_generators(rounding: StateRounding, state: dict, keys, seed: int, order: int,
                     step: int) -> dict[str, torch.Generator] | None:
    """The generators that write one parameter's bf16 moments ``keys`` of ``state`` at one step
    by stochastic rounding (``state_rounding="stochastic"``; None for ``"nearest"``): one per
    moment, seeded as the parameter's own rounding (:func:`rounding_generator` with the same
    ``seed``, ``order`` and ``step``) on a stream of the moment's name, with the offset of the
    moment's own block (a moment sharded with its parameter's rows draws per shard; one
    replicated on every rank, as the moments of a left projection's ``R`` under FSDP2, draws the
    same bits on each, so the replicas stay equal)."""
    if rounding is not StateRounding.STOCHASTIC:
        return None
    return {key: rounding_generator(seed, order, step, state[key].device, shard_offset(state[key]), stream=key)
            for key in keys if state[key].dtype == torch.bfloat16}
