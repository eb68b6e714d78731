"""AdamW and Fira under DDP and FSDP2 on several processes: throughput, communication, memory.

The model is the ``tiny`` recipe's shape: a ``transformers.LlamaForCausalLM`` with d_model 256,
4 layers, 4 heads, SwiGLU width 688, vocabulary 8192; sequence 256, global batch 8 (each of the
N ranks trains on 8 / N sequences). Tokens are random: throughput and communication do not
depend on the text. Fira: rank 64 (d_model / 4, the paper's 60M ratio), alpha 0.25,
``update_proj_gap`` small enough that refresh steps get measured too.

    python benchmarks/distributed.py --nproc 2 --out docs/benchmarks_distributed.md

runs every configuration under ``torchrun --standalone --nproc_per_node 2`` (gloo on CPU,
NCCL on GPUs) and writes the report. Per configuration and rank it measures:

* tokens/s of ordinary steps (no projection refresh) and the time of a refresh step;
* the payload of every collective per step, counted by ``fira_train.run.communication.CommunicationCounter``
  (Python collectives patched for FSDP2 and Fira, a comm hook for DDP's gradient buckets);
* per-rank bytes of parameters, gradients and optimizer state (local shards), and the
  process's peak resident memory (CUDA: peak allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

CONFIGS = [
    ("ddp", "adamw", {}),
    ("ddp", "fira", {}),
    ("ddp", "fira", {"split_refresh": True}),
    ("fsdp2", "adamw", {}),
    ("fsdp2", "fira", {}),
]


def _label(parallel: str, optimizer: str, options: dict) -> str:
    extra = " split_refresh" if options.get("split_refresh") else ""
    return f"{parallel} {optimizer}{extra}"


# ---------------------------------------------------------------------- worker (one rank)


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fira_optim
    from fira_optim.distributed import to_local
    from fira_train.run.communication import CommunicationCounter
    from fira_train.run.parallel import (
        all_reduce_mean,
        init_distributed,
        parallelize,
        shard_batch,
        unwrap,
    )

    torch.set_num_threads(args.threads)
    env = init_distributed()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(env.device)
    model = parallelize(model, args.parallel, env)
    counter = CommunicationCounter()
    if args.parallel == "ddp":
        counter.watch_ddp(model)
    options = json.loads(args.options)
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    else:
        groups = fira_optim.param_groups(unwrap(model), rank=args.rank,
                                         update_proj_gap=args.gap, alpha=0.25)
        optimizer = fira_optim.FiraAdamW(groups, lr=1e-3, **options)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 8192, (args.batch, args.seq), generator=generator)
               for _ in range(args.steps)]

    records = []
    with counter:
        for step in range(args.steps):
            batch = shard_batch(batches[step], env).to(env.device)
            counter.reset()
            t0 = time.perf_counter()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            _sync(env)
            t1 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(env)
            t2 = time.perf_counter()
            records.append({
                "step": step, "forward_backward_s": t1 - t0, "optimizer_s": t2 - t1,
                "refresh": args.optimizer == "fira" and step % args.gap == 0,
                "bytes": dict(counter.bytes), "calls": dict(counter.calls),
            })
            counter.enabled = False  # the loss average below is bookkeeping, not training
            records[-1]["loss"] = all_reduce_mean(loss, env)
            counter.enabled = True

    def local_bytes(tensors) -> int:
        return sum(to_local(t).numel() * t.element_size() for t in tensors)

    state_tensors = [v for s in optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor)]
    memory = {
        "param_bytes": local_bytes(p for p in model.parameters()),
        "optimizer_state_bytes": local_bytes(state_tensors),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if env.device.type == "cuda":
        memory["peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(env.device)
    result = {"rank": env.rank, "world_size": env.world_size, "records": records,
              "memory": memory, "device": str(env.device), "backend": env.backend}
    import torch.distributed as dist

    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, result)
    if env.is_main:
        Path(args.result).write_text(json.dumps(gathered))


def _sync(env) -> None:
    import torch

    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)


# ---------------------------------------------------------------------- driver


def summarize(runs: list[list[dict]], tokens_per_step: int) -> dict:
    """Medians over the measured steps of every repeat (rank 0's clock; steps 0 and 1 warm up)."""
    records = [r for ranks in runs for r in ranks[0]["records"][2:]]
    ordinary = [r for r in records if not r["refresh"]]
    refresh = [r for r in records if r["refresh"]]
    step_s = statistics.median(r["forward_backward_s"] + r["optimizer_s"] for r in ordinary)
    out = {
        "tokens_per_s": tokens_per_step / step_s,
        "step_s": step_s,
        "forward_backward_s": statistics.median(r["forward_backward_s"] for r in ordinary),
        "optimizer_s": statistics.median(r["optimizer_s"] for r in ordinary),
        "bytes_ordinary": _median_bytes(ordinary),
        "bytes_refresh": _median_bytes(refresh) if refresh else None,
        "memory": [r["memory"] for r in runs[-1]],
        "loss_last": runs[-1][0]["records"][-1]["loss"],
    }
    if refresh:
        out["refresh_optimizer_s"] = [
            statistics.median(r["optimizer_s"] for ranks in runs for r in ranks[rank]["records"][2:]
                              if r["refresh"])
            for rank in range(len(runs[-1]))
        ]
    return out


def _median_bytes(records: list[dict]) -> dict:
    kinds = sorted({k for r in records for k in r["bytes"]})
    return {k: int(statistics.median(r["bytes"].get(k, 0) for r in records)) for k in kinds}


def run_all(args: argparse.Namespace) -> dict:
    """Every configuration ``--repeat`` times, round-robin, so that drifting machine load hits
    them alike."""
    runs: dict[str, list] = {}
    for _ in range(args.repeat):
        for parallel, optimizer, options in CONFIGS:
            label = _label(parallel, optimizer, options)
            runs.setdefault(label, []).append(_run_one(args, parallel, optimizer, options))
    return {label: summarize(r, args.batch * args.seq) for label, r in runs.items()}


def _run_one(args: argparse.Namespace, parallel: str, optimizer: str, options: dict) -> list[dict]:
    """One configuration under torchrun; returns every rank's records."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc}", __file__, "--worker",
            "--parallel", parallel, "--optimizer", optimizer, "--options", json.dumps(options),
            "--steps", str(args.steps), "--gap", str(args.gap), "--rank", str(args.rank),
            "--batch", str(args.batch), "--seq", str(args.seq),
            "--threads", str(args.threads), "--result", str(result),
        ]
        label = _label(parallel, optimizer, options)
        print(f"[{label}] {' '.join(command[3:])}", flush=True)
        started = time.time()
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        print(f"[{label}] {time.time() - started:.0f} s", flush=True)
        return json.loads(result.read_text())


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def report(results: dict, args: argparse.Namespace, command: str) -> str:
    cpu = _cpu_name()
    lines = [
        "# Distributed benchmark: AdamW and Fira under DDP and FSDP2",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}  ",
        f"Machine: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
        f"torch {_torch_version()}; {args.nproc} processes x {args.threads} thread(s), gloo on CPU; "
        f"load average at the end {os.getloadavg()[0]:.1f} (the machine is shared: timings are noisy)  ",
        f"Model: LlamaForCausalLM d_model 256, 4 layers, 4 heads, MLP 688, vocab 8192 (7.4M "
        f"parameters, fp32); sequence {args.seq}, global batch {args.batch} "
        f"({args.batch // args.nproc} per rank), random tokens. Fira: rank {args.rank}, alpha 0.25, "
        f"update_proj_gap {args.gap} (to measure refresh steps; the recipe uses T = steps / 50).",
        "",
        "## Throughput and memory per rank",
        "",
        "| configuration | tokens/s (ordinary step) | step (s) | forward + backward (s) | "
        "optimizer step (s) | refresh optimizer step (s), per rank | params (MiB/rank) | "
        "optimizer state (MiB/rank) | peak RSS (MiB/rank) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        mem = r["memory"]
        refresh = ", ".join(f"{t:.3f}" for t in r.get("refresh_optimizer_s", [])) or "-"
        lines.append(
            f"| {label} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | "
            f"{r['forward_backward_s']:.3f} | {r['optimizer_s']:.3f} | "
            f"{refresh} | {' / '.join(_mib(m['param_bytes']) for m in mem)} | "
            f"{' / '.join(_mib(m['optimizer_state_bytes']) for m in mem)} | "
            f"{' / '.join(_mib(m['peak_rss_bytes']) for m in mem)} |"
        )
    lines += [
        "",
        "## Communication per step (payload bytes on rank 0, counted)",
        "",
        "Payload = the full logical tensor of each collective (all-reduce: the tensor; all-gather: "
        "its output; reduce-scatter: its input; gather: all pieces). A ring algorithm moves about "
        "that much per rank (twice for an all-reduce).",
        "",
        "| configuration | ordinary step | refresh step |",
        "|---|---|---|",
    ]
    for label, r in results.items():
        lines.append(f"| {label} | {_bytes_cell(r['bytes_ordinary'])} | "
                     f"{_bytes_cell(r['bytes_refresh']) if r['bytes_refresh'] else '-'} |")
    lines += ["", *_analysis(results, args)]
    return "\n".join(lines) + "\n"


def _analysis(results: dict, args: argparse.Namespace) -> list[str]:
    """Ratios computed from the tables above, and the formulas they follow."""
    out = ["## What the numbers say", ""]
    fsdp_adamw, fsdp_fira = results.get("fsdp2 adamw"), results.get("fsdp2 fira")
    if fsdp_adamw and fsdp_fira:
        base = sum(fsdp_adamw["bytes_ordinary"].values())
        extra = sum(fsdp_fira["bytes_ordinary"].values()) - base
        refresh_extra = sum(fsdp_fira["bytes_refresh"].values()) - sum(fsdp_fira["bytes_ordinary"].values())
        out += [
            f"- FSDP2, ordinary step: Fira adds {extra:,} bytes to FSDP2's own {base:,} "
            f"({100 * extra / base:.2f} %): for each left-projected m x n matrix R (r x n) and the "
            "n column norms of G, for each right-projected matrix two scalars (||S||^2 and ||phi G||^2), and one "
            "finiteness flag per gradient; three all-reduces per step whatever the number of "
            "matrices. No gradient is gathered.",
            f"- FSDP2, refresh step: + {refresh_extra:,} bytes (each projected gradient gathered "
            "once, on the one rank that computes its basis, plus the previous left bases' rows; "
            "then the bases broadcast). Spread over the paper's T = 200 steps (its 60M-7B recipes; `tiny`, "
            "whose model this is, refreshes every steps / 50 = 6) that is "
            f"{refresh_extra / 200:,.0f} bytes per step.",
        ]
    ddp, split = results.get("ddp fira"), results.get("ddp fira split_refresh")
    if ddp and split:
        one, two = ddp["refresh_optimizer_s"], split["refresh_optimizer_s"]
        out += [
            "- DDP: Fira adds nothing to DDP's gradient all-reduce on ordinary steps (every rank "
            "runs the one-process optimizer on identical gradients). With `split_refresh=True` a "
            f"refresh step's optimizer time goes from {max(one):.2f} s to {max(two):.2f} s "
            f"(slowest rank; {max(one) / max(two):.1f}x) for {sum(split['bytes_refresh'].values()) - sum(split['bytes_ordinary'].values()):,} "
            "bytes of broadcast bases.",
        ]
    adamw = results.get("ddp adamw")
    if adamw and ddp:
        out += [
            f"- Optimizer state per rank: Fira {_mib(ddp['memory'][0]['optimizer_state_bytes'])} MiB vs "
            f"AdamW {_mib(adamw['memory'][0]['optimizer_state_bytes'])} MiB under DDP; "
            + (f"{_mib(fsdp_fira['memory'][0]['optimizer_state_bytes'])} vs "
               f"{_mib(fsdp_adamw['memory'][0]['optimizer_state_bytes'])} MiB under FSDP2 "
               if fsdp_adamw and fsdp_fira else "")
            + "(most of it is the embedding and output head, which are not projected; under FSDP2 "
            "the left-projection states r x n and the right bases n x r are replicated, the rest "
            "sharded).",
        ]
    out += [
        "- Times share two cores with other work (see the load average): compare the "
        "optimizer-step column within a run, and the forward + backward column across "
        "optimizers only as a measure of the noise.",
    ]
    return out


def _bytes_cell(by_kind: dict) -> str:
    total = sum(by_kind.values())
    parts = ", ".join(f"{k} {v:,}" for k, v in by_kind.items() if v)
    return f"**{total:,}** ({parts})"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _torch_version() -> str:
    import torch

    return torch.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="run one rank (under torchrun)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--parallel", default="ddp")
    parser.add_argument("--optimizer", default="fira")
    parser.add_argument("--options", default="{}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gap", type=int, default=4)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2, help="runs per configuration, round-robin")
    parser.add_argument("--result", default="")
    parser.add_argument("--out", default="docs/benchmarks_distributed.md")
    parser.add_argument("--json", default="", help="also write the raw numbers here")
    args = parser.parse_args()
    if args.worker:
        from fira_train.run.parallel import destroy_distributed

        worker(args)
        # Only after the DDP model is gone: seen here, a DDP reducer destroyed after its process
        # group sometimes hangs at exit.
        destroy_distributed()
        return
    command = " ".join(["python benchmarks/distributed.py", *sys.argv[1:]])
    results = run_all(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report(results, args, command))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
