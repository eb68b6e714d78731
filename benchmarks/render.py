"""Render docs/benchmarks.md from the JSON that the benchmark scripts wrote (no typed numbers).

    python benchmarks/render.py
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks"


def _ms(seconds: float, device: str = "cpu") -> str:
    return f"{seconds * 1e3:.0f} ms" if device == "cpu" else f"{seconds * 1e3:.2f} ms"


def optimizer_step(data: dict) -> list[str]:
    steady, refresh, allocs = data["steady_step_s"], data["refresh_step_s"], data[
        "allocations_ge_512x512_fp32_per_step"]
    device = data.get("device", "cpu")
    cpu = device == "cpu"
    where = (f"{data['threads']} threads, {data['machine']} (2-core CPU VM)" if cpu
             else f"{device} (the lent accelerator machine)")
    lines = [
        f"## Optimizer step on {'the CPU' if cpu else device}",
        "",
        f"- Command: `{data['command']}`",
        f"- Date {data['date']}, torch {data['torch']}, {where}.",
        f"- Shapes: {data['shapes']}, rank {data['rank']}, fp32. Optimizers run round-robin in one process;"
        " median steady step (no refresh), and the first step (computes every projection).",
        f"- Machine load during the run: {data.get('load', 'not recorded')}.",
        "",
        "| optimizer | steady step | first step (all refreshes) | allocations >= one 512x512 fp32 matrix per step |",
        "|---|---|---|---|",
    ]
    for name, t in steady.items():
        lines.append(f"| {name} | {_ms(t, device)} | {_ms(refresh[name], device) if name in refresh else '-'} | "
                     f"{allocs.get(name, '-')} |")
    stagger = data["stagger"]
    lines += [
        "",
        f"- fira_optim (default `implementation=\"fast\"`) vs fira 1.0.2, steady step: **{data['speedup_vs_fira_1_0_2']:.2f}x faster**;"
        f" / floor (two GEMMs + one elementwise pass, same run): **{data['ratio_to_floor']:.2f}x**.",
    ]
    if "torch AdamW fused" in steady:
        fused = steady["torch AdamW fused"]
        lines.append(
            f"- Against torch's fused AdamW (`fused=True`, not its default on the CPU; full-rank states, no"
            f" projection): fira_optim's steady step takes {steady['fira_optim'] / fused:.1f}x as long, and the"
            f" floor, whose two GEMMs project and un-project the gradient, {steady['floor'] / fused:.1f}x. Fira"
            " saves memory, not time, against a fused full-rank step.")
    if "compiled_ratio_to_floor" in data:
        lines.append(
            f"- fira_optim `implementation=\"compiled\"`: **{data['compiled_speedup_vs_fira_1_0_2']:.2f}x faster**"
            f" than fira 1.0.2, **{data['compiled_ratio_to_floor']:.2f}x** the floor; its first step, which"
            f" compiles the kernel, took {data['compiled_first_step_s']:.1f} s (the table's first-step column"
            " for it is a later refresh step, without compilation).")
        if not cpu and data["compiled_ratio_to_floor"] > data["ratio_to_floor"]:
            lines.append(
                "- On this GPU the compiled kernel, called once per matrix, is slower than the multi-tensor"
                " path: the step is bound by launches and Python, not by memory traffic; keep the default"
                " `implementation=\"fast\"` on CUDA.")
    lines += [
        f"- First step, randomized vs exact SVD projector: {data['refresh_speedup_randomized_vs_svd']:.2f}x"
        " (the first refresh has no previous basis to warm-start from; see the projector table for refreshes).",
        f"- Refreshes spread over T = {data.get('stagger_steps', 56)} steps (`stagger=True`): worst step "
        f"{_ms(stagger['staggered']['max_step_s'], device)} vs {_ms(stagger['all at once']['max_step_s'], device)}"
        " when every matrix refreshes on the same step.",
        "",
    ]
    return lines


def projector_quality(data: dict) -> list[str]:
    return [
        "## Projector refresh on real gradients",
        "",
        f"- Command: `{data.get('command', 'python benchmarks/projector_quality.py --layers 2 --steps 16 --gap 5 --batch 2 --out docs/benchmarks/projector_quality.json')}`",
        f"- Date {data['date']}, {data['threads']} threads. Model: {data['model']}, trained with Fira on the"
        " embedded Wikipedia corpus; at every refresh after the first, each weight gradient (7 per layer:"
        " q, k, v, o 512x512, gate, up 1376x512, down 512x1376) is projected by exact SVD and by the"
        " randomized projector warm-started from the previous basis. These are early-training"
        " gradients (the first few hundred thousand tokens), measured under machine load: the"
        " timing ratio is side by side, per matrix.",
        f"- Loss {data['loss_first_last'][0]:.2f} -> {data['loss_first_last'][1]:.2f} over the run;"
        f" {data['refreshes_measured']} matrix refreshes measured; power iterations {data['power_iters']}.",
        "",
        "| projector | total refresh time | captured top-r energy (min / median) |",
        "|---|---|---|",
        f"| exact SVD (`torch.linalg.svd`, fp32) | {data['svd_total_s']:.2f} s | 1 (by definition) |",
        f"| randomized, warm-started | {data['randomized_total_s']:.2f} s | {data['energy_min']:.7f} / "
        f"{data['energy_median']:.7f} |",
        f"| previous basis, not refreshed | 0 | median {data['energy_previous_basis_median']:.4f} |",
        "",
        f"- Randomized refresh speed-up: **{data['speedup']:.1f}x**.",
        "",
    ]


def refresh_threads(data: dict) -> list[str]:
    median = data["refresh_seconds_median"]
    shapes = ", ".join(f"{n} x {shape}" for shape, n in data["shapes"].items())
    lines = [
        f"## One exact-SVD refresh on `{data['recipe']}`, by route and threading",
        "",
        f"- Command: `{data['command']}`",
        f"- Date {data['date']}, {data['machine']}; {data['load']}.",
        f"- The {data['matrices']} projected gradients ({shapes}; rank {data['rank']}) of the recipe's model after a"
        " few Fira steps on the embedded corpus, all decomposed once per configuration; configurations take"
        " turns, median over rounds. `tall`: the tall orientation, plain SVD; `QR first`: a tall matrix at"
        f" least {data['qr_first_ratio']:g} times taller than wide gives its small-side vectors from the SVD of its"
        " QR factor R. In a pool, `all threads per worker` leaves each worker at the default (MKL opens an"
        " OpenMP team of every core in each); `1 thread per worker` sets one thread in each worker as it starts.",
        "",
        "| configuration | one refresh of every matrix |",
        "|---|---|",
    ]
    lines += [f"| {name} | {_ms(t)} |" for name, t in median.items()]
    before = "pool, all threads per worker, tall"
    raw, aligned = "pool, 1 thread per worker, tall", "pool, 1 thread per worker, QR first"
    if before in median and raw in median and aligned in median:
        lines += ["", f"- FiraAdamW refreshes with `{raw}` by default (raw SVD signs) and with `{aligned}` "
                      f"with `align_signs=True`; before the one-thread workers, with `{before}`: now "
                      f"**{median[before] / median[raw]:.2f}x** and **{median[before] / median[aligned]:.2f}x "
                      f"faster**."]
    return lines + [""]


def throughput(data: dict) -> list[str]:
    lines = [
        f"## Training throughput on `{data['recipe']}`",
        "",
        f"- Command: `{data['command']}`",
        f"- Date {data['date']}, {data['machine']}; {data['load']}.",
        f"- Each method trains its own model on the same batches; the methods take turns, one refresh"
        f" period ({data['steps_per_round']} steps of {data['tokens_per_step']:,} tokens) each per round,"
        " so every Fira/GaLore round holds exactly one projection refresh; ratios are per round, median"
        " reported." + (f" Fira/GaLore rank {data['rank']}, T = {data['update_proj_gap']}." if "rank" in data else ""),
        "",
        "| method | tokens/s (median round) | vs AdamW (median of per-round ratios) | per round |",
        "|---|---|---|---|",
    ]
    pooled = data.get("ratio_to_adamw_pooled")
    if pooled:
        lines[-2] = lines[-2].replace(" | per round |", " | per round | optimizer s per round | vs AdamW, pooled forward/backward |")
        lines[-1] += "---|---|"
    for name, tps in data["tokens_per_s_median"].items():
        rounds = ", ".join(f"{r:.3f}" for r in data["ratio_to_adamw_per_round"][name])
        row = f"| {name} | {tps:,.0f} | {data['ratio_to_adamw_median'][name]:.1%} | {rounds} |"
        if pooled:
            row += f" {data['optimizer_seconds_per_round_median'][name]:.3f} | **{pooled[name]:.1%}** |"
        lines.append(row)
    spread = data.get("ratio_to_adamw_pooled_per_round")
    if pooled:
        lines += [""]
        median = data["ratio_to_adamw_median"]
        lines.append("- Two estimates of the same runs, which differ: the median of the per-round tokens/s ratios"
                     " (third column) and the pooled estimate (last column, in bold): " + "; ".join(
                         f"{m} {median[m]:.1%} and {pooled[m]:.1%}" for m in pooled if m != "adamw")
                     + ". Where the documentation quotes one throughput figure, it is the pooled one, and says so.")
        if spread:
            lines.append("- The same pooled estimate round by round (each round's forward + backward pooled over its"
                         " methods), lowest / median / highest: " + "; ".join(
                             f"{m} {min(v):.1%} / {statistics.median(v):.1%} / {max(v):.1%}"
                             for m, v in spread.items() if m != "adamw") + ".")
        lines += [
            f"- The per-round ratios scatter by several percent (the machine's speed drifts); the last column"
            f" pools the forward + backward time of all rounds and methods"
            f" ({data['forward_backward_seconds_per_round_median']:.2f} s per round) and adds each method's own"
            " median time after the backward passes (clipping, optimizer with its one refresh per round,"
            " schedule). The target for Fira is at least 97% of AdamW's throughput by the pooled estimate"
            f" (here {pooled['fira']:.1%}; by the median of per-round ratios Fira is at {median['fira']:.1%}).",
            f"- Fira spends {data['optimizer_seconds_per_round_median']['fira'] - data['optimizer_seconds_per_round_median']['adamw']:.2f} s"
            " per round more than AdamW in the optimizer; GaLore, which does the same SVD refresh and"
            " projections without the residual, spends"
            f" {data['optimizer_seconds_per_round_median']['galore'] - data['optimizer_seconds_per_round_median']['adamw']:.2f} s"
            " more.",
        ]
    slowest, others = data.get("slowest_step_seconds_median"), data.get("other_steps_seconds_median")
    if slowest and others:
        parts = ", ".join(f"{m} {others[m] * 1e3:.0f} ms and {slowest[m] * 1e3:.0f} ms" for m in slowest)
        lines.append("- Time after the backward passes, median over rounds, for the other steps of a round and"
                     f" for its slowest step (the one that refreshes the projections, every T = {data['steps_per_round']}"
                     f" steps, for the Fira/GaLore family): {parts}.")
    # Earlier runs kept beside the newest (throughput_<recipe>_<label>.json), one line each.
    for kept in sorted(RESULTS.glob(f"throughput_{data['recipe']}_*.json")):
        if kept.name in SECTIONS:  # a section of its own (the memory options)
            continue
        run = json.loads(kept.read_text())
        ratios = ", ".join(f"{m} {r:.1%}" for m, r in run["ratio_to_adamw_pooled"].items() if m != "adamw")
        medians = ", ".join(f"{m} {r:.1%}" for m, r in run["ratio_to_adamw_median"].items() if m != "adamw")
        lines.append(f"- Kept run `{kept.name}` (written to its command's `--out`, then renamed), rank {run['rank']}: "
                     f"`{run['command']}` ({run['date']}; forward + backward"
                     f" {run['forward_backward_seconds_per_round_median']:.2f} s per round), pooled: {ratios};"
                     f" median of per-round ratios: {medians}.")
    lines.append("")
    return lines


def throughput_bf16(data: dict) -> list[str]:
    """bf16 weights: Fira's default (fast) path against the reference path, which every bf16 matrix
    took before the fast path covered them, and AdamW, side by side on the same batches."""
    median, per_round, pooled = data["ratio_to_adamw_median"], data["ratio_to_adamw_per_round"], data["ratio_to_adamw_pooled"]
    optimizer = data["optimizer_seconds_per_round_median"]
    name = "throughput_tiny_bf16.json"
    reference = "fira@optim.implementation=reference"
    rounds = len(per_round["adamw"])
    command = re.sub(r" --out \S+", "", data["command"])  # the overrides after it kept
    lines = [
        f"## Training throughput with bf16 weights on `{data['recipe']}`",
        "",
        f"`{command}`",
        f"on {data['date']}, this project's 2-core CPU, {data['machine'].split(', ', 2)[-1]} (JSON:",
        f"[benchmarks/{name}](benchmarks/{name})). `{reference}` is the path every bf16 matrix took",
        "before the fast path covered bf16 weights. Tokens/s relative to AdamW (bf16 weights too), side by",
        f"side on the same batches: the median over {rounds} rounds of the per-round ratio, its range, the",
        "pooled estimate, and the time after the backward passes per round (clipping, optimizer, schedule):",
        "",
        "| method | median of rounds | rounds | pooled | optimizer s per round |",
        "|---|---|---|---|---|",
    ]
    for m, v in per_round.items():
        lines.append(f"| {m} | {median[m]:.1%} | {100 * min(v):.1f}-{100 * max(v):.1f}% | {pooled[m]:.1%} "
                     f"| {optimizer[m]:.3f} |")
    lines += ["", f"With bf16 weights, Fira's optimizer took {optimizer['fira']:.3f} s per round against "
                  f"{optimizer[reference]:.3f} s through the reference path ({optimizer[reference] / optimizer['fira']:.2f}"
                  f" times as long), AdamW's {optimizer['adamw']:.3f} s. One run of {rounds} rounds.", ""]
    return lines


def throughput_memory_options(data: dict) -> list[str]:
    """Fira's memory options: the per-round ratios compare them all (with ``step_in_backward`` the
    optimizer runs inside the backward pass, so the pooled estimate applies to the others only).
    Each option's cost is stated against plain Fira and against the 10% the options may cost."""
    median, per_round = data["ratio_to_adamw_median"], data["ratio_to_adamw_per_round"]
    pooled = data["ratio_to_adamw_pooled"]
    name = "throughput_tiny_memory_options.json"
    command = data["command"].split(" --out ")[0]
    rounds = len(per_round["adamw"])
    lines = [
        f"## Training throughput of Fira's memory options on `{data['recipe']}`",
        "",
        f"`{command}`",
        f"on {data['date']}, this project's 2-core CPU, {data['machine'].split(', ', 2)[-1]} (JSON:",
        f"[benchmarks/{name}](benchmarks/{name})).",
        f"Tokens/s relative to AdamW, side by side on the same batches: the median over {rounds} rounds of",
        "the per-round ratio, its range, and the pooled estimate where it applies (not with",
        "`step_in_backward`: the optimizer then runs inside the backward pass, which the pooled estimate",
        "assumes costs every method the same):",
        "",
        "| method | median of rounds | rounds | pooled | cost against plain Fira (medians) |",
        "|---|---|---|---|---|",
    ]
    for m, v in per_round.items():
        if m == "adamw":
            continue
        in_backward = "step_in_backward=true" in m
        cost = "-" if m == "fira" else f"{100 * (1 - median[m] / median['fira']):.1f}%"
        lines.append(f"| {m} | {median[m]:.1%} | {100 * min(v):.1f}-{100 * max(v):.1f}% "
                     f"| {'-' if in_backward else f'{pooled[m]:.1%}'} | {cost} |")
    options = [m for m in per_round if m not in ("adamw", "fira")]
    within = [m for m in options if 1 - median[m] / median["fira"] <= 0.10]
    beyond = [m for m in options if m not in within]
    lines += ["", f"Within the 10% the memory options may cost (median against plain Fira): "
                  f"{', '.join(f'`{m}`' for m in within) or 'none'}; beyond it: "
                  f"{', '.join(f'`{m}`' for m in beyond) or 'none'}. One run of {rounds} rounds."]
    return lines


def allocator(data: dict) -> list[str]:
    """What an allocator setting costs in tokens/s: alternating processes, paired by pair."""
    command = re.sub(r" --out \S+", "", data["command"])
    pairs = len(next(iter(data["summary"].values()))["ratios"])
    lines = [
        f"## Training speed with `{data['setting']}` on `{data['recipe']}`",
        "",
        f"`{command}`",
        f"on {data['date']}, {data['machine']} ({data['load']}). glibc reads the setting when a process",
        f"starts, so the script alternates {2 * pairs} processes without and with it (AB, BA, ...), each",
        f"timing every method side by side over {data['rounds']} rounds. Tokens/s with the setting / without",
        "it, per pair of processes:",
        "",
        "| method | mean ratio (95% interval) | median | pairs |",
        "|---|---|---|---|",
    ]
    for m, s in data["summary"].items():
        lines.append(f"| {m} | {s['ratio_mean']:.3f} [{s['ratio_low']:.3f}, {s['ratio_high']:.3f}] "
                     f"| {s['ratio_median']:.3f} | {', '.join(f'{r:.3f}' for r in s['ratios'])} |")
    return lines


SECTIONS = {"optimizer_step.json": optimizer_step, "optimizer_step_cuda.json": optimizer_step,
            "projector_quality.json": projector_quality, "refresh_micro.json": refresh_threads,
            "refresh_tiny.json": refresh_threads,
            "throughput_tiny.json": throughput,
            "throughput_tiny_memory_options.json": throughput_memory_options,
            "throughput_tiny_bf16.json": throughput_bf16,
            "allocator_tiny.json": allocator}


def render() -> str:
    """The page, from the JSON in ``docs/benchmarks/``."""
    out = ["# Benchmarks", "",
           "Every number below was written by the script named with it; `benchmarks/render.py` turns",
           "their JSON (in `docs/benchmarks/`) into this page. Distributed runs: [benchmarks_distributed.md](benchmarks_distributed.md).",
           ""]
    for name, section in SECTIONS.items():
        path = RESULTS / name
        if path.exists():
            out += section(json.loads(path.read_text()))
    return "\n".join(out) + "\n"


def main() -> None:
    (ROOT / "docs" / "benchmarks.md").write_text(render())


if __name__ == "__main__":
    main()
