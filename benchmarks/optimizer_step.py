"""Optimizer-step benchmark on LLaMA-60M matrix shapes.

Side by side in one process: torch.optim.AdamW, fira 1.0.2, galore-torch 1.0,
pytorch_optimizer.Fira and fira_optim (exact SVD, randomized projector, staggered refreshes),
plus the floor of a Fira step: the two GEMMs it cannot avoid (P^T G, then P X added into the
parameter) and one elementwise pass (c * G added into the parameter).

Shapes: 8 layers x (q, k, v, o 512x512; gate, up 1376x512; down 512x1376), rank 128, fp32.

    python benchmarks/optimizer_step.py --threads 2 --out docs/benchmarks/optimizer_step.json
    python benchmarks/optimizer_step.py --device cuda --out docs/benchmarks/optimizer_step_cuda.json

Optimizers are run round-robin (a few steps each, repeated, the order rotating every round)
so that drift in machine load and the state each leaves behind hit all of them alike; the
median steady step is reported.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
from record import provenance, save

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fira_optim"))

LAYER = [(512, 512)] * 4 + [(1376, 512), (1376, 512), (512, 1376)]


def shapes(layers: int) -> list[tuple[int, int]]:
    return LAYER * layers


DEVICE = torch.device("cpu")


def make_params(shape_list, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(DEVICE)) for s in shape_list]
    grads = [(torch.randn(s, generator=g) * 1e-3).to(DEVICE) for s in shape_list]
    return params, grads


def build(name: str, params, rank: int, gap: int):
    """The optimizer under test, projecting every matrix with the same rank and gap."""
    lr = 1e-3
    if name == "torch AdamW":
        return torch.optim.AdamW(params, lr=lr)
    if name == "torch AdamW fused":  # torch's fused kernel (not its default on the CPU): full-rank states
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "fira 1.0.2":
        import fira

        return fira.FiraAdamW(
            [{"params": params, "rank": rank, "update_proj_gap": gap, "alpha": 0.25, "proj_type": "std"}],
            lr=lr, no_deprecation_warning=True,
        )
    if name == "galore-torch 1.0":
        # galore_torch's __init__ imports bitsandbytes; its AdamW needs none of it.
        from released import galore_adamw_class

        return galore_adamw_class()(
            [{"params": params, "rank": rank, "update_proj_gap": gap, "scale": 0.25, "proj_type": "std"}],
            lr=lr, no_deprecation_warning=True,
        )
    if name == "pytorch_optimizer.Fira":
        import pytorch_optimizer

        return pytorch_optimizer.Fira(
            [{"params": params, "rank": rank, "update_proj_gap": gap, "scale": 0.25,
              "projection_type": "std"}], lr=lr,
        )
    from fira_optim import FiraAdamW

    options = {
        "fira_optim": {},
        "fira_optim randomized": {"projector": "randomized"},
        "fira_optim reference": {},
        "fira_optim compiled": {},
    }[name]
    impl = name.split()[-1] if name.endswith(("reference", "compiled")) else "fast"
    return FiraAdamW([{"params": params, "rank": rank, "update_proj_gap": gap, **options}],
                     lr=lr, implementation=impl)


class Floor:
    """What a Fira step cannot avoid: GEMM1 (R = P^T G), GEMM2 (W += P X), one pass (W += c G)."""

    def __init__(self, params, grads, rank):
        from fira_optim.projection import LEFT, projection_side

        self.items = []
        for p, g in zip(params, grads):
            side = projection_side(p.shape, "std")
            m, n = p.shape
            basis = torch.linalg.qr(torch.randn(m if side == LEFT else n, rank, device=DEVICE))[0]
            c = torch.rand((1, n) if side == LEFT else (m, 1), device=DEVICE)
            self.items.append((p, g, basis, side, c))

    @torch.no_grad()
    def step(self):
        for p, g, basis, side, c in self.items:
            if side == "left":
                low = basis.T @ g
                p.addmm_(basis, low, alpha=-1e-3)
            else:
                low = g @ basis
                p.addmm_(low, basis.T, alpha=-1e-3)
            p.addcmul_(g, c, value=-1e-3)


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def large_allocations(opt, params, threshold_bytes: int) -> int:
    """Allocations of at least ``threshold_bytes`` (one m x n fp32 matrix) during one step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        opt.step()
        _sync()
    field = "self_device_memory_usage" if DEVICE.type == "cuda" else "self_cpu_memory_usage"
    return sum(1 for e in prof.events() if (getattr(e, field, None) or 0) >= threshold_bytes)


def stagger_profile(layers: int, rank: int, steps: int) -> dict:
    """Worst step over one refresh period, with and without staggered refreshes."""
    from fira_optim import FiraAdamW

    out = {}
    for stagger in (False, True):
        params, grads = make_params(shapes(layers), seed=3)
        set_grads(params, grads)
        opt = FiraAdamW([{"params": params, "rank": rank, "update_proj_gap": steps,
                          "stagger": stagger}], lr=1e-3)
        opt.step()  # the first step initialises every basis in both cases
        times = [timed(opt.step) for _ in range(steps)]
        out["staggered" if stagger else "all at once"] = {
            "max_step_s": max(times), "median_step_s": statistics.median(times),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9, help="round-robin rounds (the order rotates: 9 = once per position)")
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--stagger-steps", type=int, default=56, help="T for the stagger profile")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (fp32 parameters either way)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device!r}: no CUDA device is available")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    # The compiled path's first step is timed as a user's first run meets it: with an empty
    # compile cache (kernels that earlier runs, or the tests, left in the shared one load in a
    # fraction of the time).
    cache = tempfile.mkdtemp(prefix="optimizer-step-inductor-")
    atexit.register(shutil.rmtree, cache, True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache

    names = ["torch AdamW", "torch AdamW fused", "fira 1.0.2", "galore-torch 1.0", "pytorch_optimizer.Fira",
             "fira_optim", "fira_optim compiled", "fira_optim randomized", "fira_optim reference"]
    never = 10**9  # no refresh during the steady-state measurement
    runs, refresh = {}, {}
    for name in names:
        params, grads = make_params(shapes(args.layers))
        set_grads(params, grads)
        opt = build(name, params, args.rank, never)
        refresh[name] = timed(opt.step)  # step 0: every projection is computed
        if name.endswith("compiled"):  # step 0 compiled the kernel: time a refresh without it
            for p, g in zip(params, grads):
                p.grad = g
            compile_s = refresh[name]
            opt.param_groups[0]["update_proj_gap"] = 1
            refresh[name] = timed(opt.step)
            opt.param_groups[0]["update_proj_gap"] = never
        runs[name] = (opt, params)
    params, grads = make_params(shapes(args.layers))
    floor = Floor(params, grads, args.rank)
    samples = {name: [] for name in [*names, "floor"]}
    steppers = {**{name: runs[name][0].step for name in names}, "floor": floor.step}
    order = list(steppers)
    for r in range(args.rounds):
        # The order rotates every round: each one runs after every other equally often, so
        # what a predecessor leaves behind (cache, allocator state: the reference path's m x n
        # temporaries) does not always fall on the same one.
        for name in order[r % len(order):] + order[: r % len(order)]:
            samples[name] += [timed(steppers[name]) for _ in range(args.steps_per_round)]
    steady = {name: statistics.median(v) for name, v in samples.items()}

    m, n = 512, 512
    threshold = m * n * 4
    allocs = {}
    for name in ["torch AdamW", "fira 1.0.2", "fira_optim", "fira_optim compiled", "fira_optim reference"]:
        opt, params = runs[name]
        allocs[name] = large_allocations(opt, params, threshold)

    result = {
        **provenance(),
        "stagger_steps": args.stagger_steps,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": args.threads,
        "shapes": f"{args.layers} layers x (q,k,v,o 512x512; gate, up 1376x512; down 512x1376)",
        "rank": args.rank,
        "steady_step_s": steady,
        "refresh_step_s": refresh,
        "allocations_ge_512x512_fp32_per_step": allocs,
        "speedup_vs_fira_1_0_2": steady["fira 1.0.2"] / steady["fira_optim"],
        "ratio_to_floor": steady["fira_optim"] / steady["floor"],
        "compiled_speedup_vs_fira_1_0_2": steady["fira 1.0.2"] / steady["fira_optim compiled"],
        "compiled_ratio_to_floor": steady["fira_optim compiled"] / steady["floor"],
        "compiled_first_step_s": compile_s,
        "refresh_speedup_randomized_vs_svd": refresh["fira_optim"] / refresh["fira_optim randomized"],
        "stagger": stagger_profile(args.layers, args.rank, args.stagger_steps),
    }
    print(json.dumps(result, indent=2))
    save(result, args.out)


if __name__ == "__main__":
    main()
