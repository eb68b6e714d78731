"""Small shared helpers for the optimizer tests: gradients with low-rank structure, runs that
inject the same gradients into two optimizers, and snapshots of params and state."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import torch

from fira_optim import FiraAdamW

WIDE, TALL, SQUARE = (12, 20), (20, 12), (16, 16)  # left, right, right (the m == n tie rule)
SHAPES = (WIDE, TALL, SQUARE)


def structured_grad(shape: Sequence[int], generator: torch.Generator, dtype=torch.float32,
                    scale: float = 1.0) -> torch.Tensor:
    """A rank-3 signal plus noise: the top singular vectors are well separated, so two SVDs of
    the same matrix agree and a refresh picks a clearly different subspace each time."""
    m, n = shape
    a = torch.randn(m, 3, generator=generator, dtype=torch.float64)
    b = torch.randn(3, n, generator=generator, dtype=torch.float64)
    noise = torch.randn(m, n, generator=generator, dtype=torch.float64)
    return (scale * (a @ b + 0.3 * noise)).to(dtype)


def grad_sequence(shapes: Sequence[Sequence[int]], steps: int, seed: int = 0,
                  dtype=torch.float32) -> list[list[torch.Tensor]]:
    """``steps`` lists of one gradient per shape (0-d and 1-D shapes get plain Gaussian noise).

    Step 5 is scaled up 20x so that the norm-growth limiter engages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        scale = 20.0 if k == 5 else 1.0 + 0.1 * k
        row = []
        for shape in shapes:
            if len(shape) == 2 and min(shape) > 0:
                row.append(structured_grad(shape, g, dtype, scale))
            else:
                noise = torch.randn(tuple(shape), generator=g, dtype=torch.float64)
                row.append((scale * noise).to(dtype))
        out.append(row)
    return out


def make_params(shapes: Sequence[Sequence[int]], seed: int = 1,
                dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(tuple(s), generator=g, dtype=torch.float64).to(dtype))
            for s in shapes]


def clone_params(params: Sequence[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params]


def set_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone().to(p.dtype)


def run(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], grads: Sequence[Sequence],
        after_step: Callable[[int], None] | None = None) -> None:
    for k, row in enumerate(grads):
        set_grads(params, row)
        opt.step()
        if after_step is not None:
            after_step(k)


def state_snapshot(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """The state of every param, in param-group order, cloned."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append({k: (v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in opt.state.get(p, {}).items()})
    return out


def assert_states_equal(a: list[dict], b: list[dict]) -> None:
    """Bitwise equality of two :func:`state_snapshot` results (same keys, dtypes, values)."""
    assert len(a) == len(b)
    for i, (sa, sb) in enumerate(zip(a, b)):
        assert sa.keys() == sb.keys(), f"param {i}: keys {sorted(sa)} != {sorted(sb)}"
        for key in sa:
            va, vb = sa[key], sb[key]
            if isinstance(va, torch.Tensor):
                assert va.dtype == vb.dtype, f"param {i} {key}: {va.dtype} != {vb.dtype}"
                assert va.shape == vb.shape, f"param {i} {key}: shape {tuple(va.shape)} != {tuple(vb.shape)}"
                # the bytes, not torch.equal: a NaN that a step left equals itself bit for bit
                assert torch.equal(_bytes(va), _bytes(vb)), f"param {i} {key} differs"
            else:
                assert va == vb, f"param {i} {key}: {va} != {vb}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage bytes in element order (a 0-d tensor as one element)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_params_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
        assert pa.dtype == pb.dtype
        assert torch.equal(_bytes(pa), _bytes(pb)), (
            f"param {i} differs: max |diff| = {(pa - pb).abs().max().item():.3e}")


def round_trip(state_dict: dict) -> dict:
    """torch.save + torch.load(weights_only=True): what a checkpoint does."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def low_rank_run(implementation: str, dtype: torch.dtype, shape: tuple[int, int] = (64, 64), rank: int = 8,
                 batch: int = 4, steps: int = 6):
    """A linear layer with an ``out x in`` weight of ``shape`` trained on batches of ``batch``
    rows (G of rank ``batch`` < ``rank``), its first basis kept: ``(weights, ||S|| and f per
    step, the limiter's history)``."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    opt = FiraAdamW([{"params": [layer.weight], "rank": rank}], lr=1e-2, update_proj_gap=100,
                    implementation=implementation)
    seen = []
    opt.register_step_stats_hook(lambda o, stats: seen.append((stats[0].residual_norm.item(),
                                                              stats[0].limiter_factor.item())))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(batch, shape[1], generator=gen, dtype=dtype)
        y = torch.randn(batch, shape[0], generator=gen, dtype=dtype)
        ((layer(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return layer.weight.detach().clone(), seen, opt.state[layer.weight]["prev_norm"].item()
