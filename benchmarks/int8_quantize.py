"""Block-wise int8 quantization on the CPU: fira_optim's lookup quantizer against torchao's and
bitsandbytes', for speed and for exactness.

    python benchmarks/int8_quantize.py [--sizes 4096 65536 1048576 4194304] [--repeats 7]
        [--out docs/benchmarks/int8_quantize.json]

Each size is quantized twice (seed 0), one absmax scale per 256 elements: a normal random tensor
with the signed dynamic map (256 values; first moments), and a positive one spanning four decades
(``|N(0, 1)| * 10^-U(0, 4)``; the square roots of second moments) with the unsigned map, by:

- ``fira_optim``: :func:`fira_optim.precision._quantize` (a 65536-entry table on the top 16 bits
  of each scaled float32, then one comparison), and its decode;
- ``torchao``: ``scale_tensor`` then ``quantize_8bit_with_qmap`` (a branchless 8-round binary
  search), and ``dequant_with_qmap``;
- ``bitsandbytes``: ``quantize_blockwise`` / ``dequantize_blockwise`` with the same map and block
  size (its CPU kernel, on its own threads), where bitsandbytes is installed.

Times are the median of ``--repeats`` calls, per element, with torch on one thread. Exactness:
the share of codes that differ from the nearest map value (a float64 search over the map, ties
upwards as torchao rounds), and the largest difference in codes. The docstring of
:mod:`fira_optim.precision` quotes this script's committed JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

import torch

from fira_optim import precision
from record import machine, provenance, save


def _median_ns_per_element(call, numel: int, repeats: int) -> float:
    call()  # warm: the tables, the allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / numel * 1e9


def _nearest(scaled: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """The code of the map value nearest to each element, in float64 (ties go up)."""
    m = qmap.double()
    mids = (m[:-1] + m[1:]) / 2
    return torch.searchsorted(mids, scaled.double(), right=True).to(torch.uint8)


def _compared(codes: torch.Tensor, nearest: torch.Tensor) -> dict[str, float]:
    diff = (codes.int() - nearest.int()).abs()
    return {"share_of_codes_not_nearest": float((diff > 0).float().mean()), "max_code_difference": int(diff.max())}


def measure(numel: int, signed: bool, repeats: int) -> dict:
    quant_utils = precision._quantization()
    qmap = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    value = torch.randn(numel, generator=generator)
    if not signed:
        value = value.abs_() * torch.pow(10.0, -4 * torch.rand(numel, generator=generator))
    scaled, _ = quant_utils.scale_tensor(value, precision.BLOCK)
    nearest = _nearest(scaled, qmap)
    ours, ours_scale = precision._quantize(value, signed=signed)
    theirs = quant_utils.quantize_8bit_with_qmap(scaled, qmap)
    row = {
        "elements": numel,
        "map": "signed" if signed else "unsigned",
        "ns_per_element": {
            "fira_optim quantize": _median_ns_per_element(lambda: precision._quantize(value, signed=signed), numel,
                                                          repeats),
            "torchao quantize": _median_ns_per_element(
                lambda: quant_utils.quantize_8bit_with_qmap(quant_utils.scale_tensor(value, precision.BLOCK)[0], qmap),
                numel, repeats),
            "fira_optim decode": _median_ns_per_element(lambda: precision._dequantize(ours, ours_scale, signed), numel,
                                                        repeats),
            "torchao decode": _median_ns_per_element(lambda: quant_utils.dequant_with_qmap(ours, qmap, ours_scale),
                                                     numel, repeats),
        },
        "exactness": {"fira_optim": _compared(ours, nearest), "torchao": _compared(theirs, nearest)},
    }
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its notes on optional kernels it cannot load
            import bitsandbytes.functional as bnb
    except ImportError:
        return row
    codes, state = bnb.quantize_blockwise(value, code=qmap, blocksize=precision.BLOCK)
    row["ns_per_element"]["bitsandbytes quantize (own threads)"] = _median_ns_per_element(
        lambda: bnb.quantize_blockwise(value, code=qmap, blocksize=precision.BLOCK), numel, repeats)
    row["ns_per_element"]["bitsandbytes decode (own threads)"] = _median_ns_per_element(
        lambda: bnb.dequantize_blockwise(codes, state), numel, repeats)
    row["exactness"]["bitsandbytes"] = _compared(codes.view(-1), nearest)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1 << 20, 1 << 22])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    for size in args.sizes:
        if size <= 0 or size % precision.BLOCK:
            parser.error(f"--sizes: {size} is not a positive multiple of the block size {precision.BLOCK}")
    torch.set_num_threads(1)
    rows = []
    for signed in (True, False):
        for size in args.sizes:
            row = measure(size, signed, args.repeats)
            rows.append(row)
            times = ", ".join(f"{name} {ns:.2f}" for name, ns in row["ns_per_element"].items())
            exact = ", ".join(f"{name} {e['share_of_codes_not_nearest']:.2%} (up to {e['max_code_difference']})"
                              for name, e in row["exactness"].items())
            print(f"{row['map']} map, {size} elements: ns per element: {times}; codes not the nearest: {exact}")
    save({**provenance(), "machine": machine("torch on 1 thread"), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
