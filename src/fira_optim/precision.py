r"""The precision of optimizer states (``state_dtype``) and stochastic rounding of bf16 weights.

``state_dtype="float32"`` (default) keeps every state in the working dtype, at least fp32.
``"bfloat16"`` stores the moments (low-rank and unprojected) and the basis in bf16.
``"int8"`` stores each moment block-wise quantized: 8-bit codes of the dynamic (tree)
quantization map of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (2022), one
fp32 absmax scale per block of 256 elements, as bitsandbytes and torchao do; the basis is bf16
(an orthonormal basis does not survive 8 bits). Moments of fewer than 4096 elements, or not a
multiple of 256, stay fp32 (their bytes do not matter; torchao's rule). The limiter's
:math:`\|S_{t-1}\|` and the step counters stay fp32.

Every step decodes a matrix's states to fp32, runs the stages on them, and encodes them back, so
the arithmetic is the fp32 arithmetic on rounded states. Bytes per element of a moment: 4, 2,
or 1 + 4/256.

The quantization map and the quantize / dequantize kernels are torchao's
(``torchao.optim.quant_utils``; ``pip install torchao``, needed for ``"int8"`` only). Its
``OptimState8bit`` tensor subclass is not used: a state dict of plain ``uint8`` codes and
``float32`` scales loads with ``torch.load(weights_only=True)`` without allow-listing a class,
and stays readable without torchao.

Stochastic rounding (``stochastic_rounding=True``) writes an update formed in fp32 into a bf16
parameter by rounding up or down with probabilities proportional to the distances, so small
updates are not lost to round-to-nearest on average. The random bits come from a generator
seeded by the optimizer's ``seed``, the matrix and the step, so a resumed run rounds as the
uninterrupted one did.
"""

from __future__ import annotations

import functools
import logging

import torch

from .options import StateDtype

#: Elements per quantization block, and the fewest elements a quantized moment has.
BLOCK = 256
MIN_QUANTIZED = 4096

#: Moment keys of every base, and whether their values can be negative (signed map).
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "sum": False, "square_avg": False}


def _scale_key(key: str) -> str:
    return f"{key}_scale"


def quantized(numel: int) -> bool:
    return numel >= MIN_QUANTIZED and numel % BLOCK == 0


def moment_zeros(shape, kind: StateDtype, work_dtype: torch.dtype, device, key: str,
                 make=None) -> dict[str, torch.Tensor]:
    """The stored form of a zero moment ``key`` of ``shape``: ``{key: ...}`` plus, for int8,
    ``{key_scale: ...}``. ``make(shape, dtype)`` builds a tensor (default ``torch.zeros``)."""
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
            working[key] = _dequantize(codes, state[_scale_key(key)], SIGNED[key]).to(work_dtype)
        elif stored.dtype != work_dtype:
            working[key] = stored.to(work_dtype)
    return working


def encode(state: dict, working: dict, keys) -> None:
    """Write the updated moments of ``working`` back into their stored form in ``state``."""
    for key in keys:
        stored, value = state[key], working[key]
        if value is stored:
            continue
        if stored.dtype == torch.uint8:
            codes, scale = _quantize(value, SIGNED[key])
            stored.copy_(codes)
            state[_scale_key(key)].copy_(scale)
        else:
            stored.copy_(value)


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


#: Elements quantized or dequantized at a time (whole blocks): bounds the temporaries of a large
#: moment (an embedding's) to a few MB instead of several times the moment in int64 codes.
CHUNK = 1 << 20


def _quantize(value: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q = _quantization()
    flat = value.reshape(-1)
    codes = torch.empty(flat.shape, dtype=torch.uint8, device=value.device)
    scale = torch.empty(flat.numel() // BLOCK, dtype=torch.float32, device=value.device)
    qmap = _qmap(signed, value.device)
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start : start + CHUNK].float()
        scaled, part_scale = q.scale_tensor(part, BLOCK)
        codes[start : start + part.numel()] = q.quantize_8bit_with_qmap(scaled, qmap)
        scale[start // BLOCK : (start + part.numel()) // BLOCK] = part_scale
    return codes.view(value.shape), scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    q = _quantization()
    flat = codes.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.float32, device=codes.device)
    qmap = _qmap(signed, codes.device)
    for start in range(0, flat.numel(), CHUNK):
        stop = min(start + CHUNK, flat.numel())
        out[start:stop] = q.dequant_with_qmap(flat[start:stop], qmap, scale[start // BLOCK : stop // BLOCK])
    return out.view(codes.shape)


def round_into(param: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None) -> None:
    """``param.copy_(value)``, by stochastic rounding where ``generator`` is given and ``param``
    is bf16: the 16 low bits of each fp32 value get uniform noise before they are cut off."""
    if generator is None or param.dtype != torch.bfloat16:
        param.copy_(value)
        return
    bits = value.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32,
                          device="cpu").to(bits.device)
    rounded = (bits + noise).bitwise_and_(-65536).view(torch.float32)
    param.copy_(rounded)  # exact: the low 16 bits are zero


def rounding_generator(seed: int, order: int, step: int) -> torch.Generator:
    """The generator of one matrix's stochastic rounding at one step (resume-exact)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + order * 7919 + step * 104_729 + 17) % (2**63))
