"""The Markdown summaries of fine-tuning: one run's ``report.md`` (:func:`render_report`) and the
comparison of several runs on the same examples (:func:`render_comparison`, used by
``benchmarks/finetune_commonsense.py``).

Accuracies carry 95% Wilson score intervals (:func:`fira_train.finetune.stats.wilson_interval`);
two runs are compared example by example with McNemar's exact test
(:func:`fira_train.finetune.stats.mcnemar_exact`, pairing by :mod:`fira_train.finetune.paired`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from fira_train.finetune.config import LORA_METHODS
from fira_train.finetune.paired import Paired, compare, pool
from fira_train.finetune.stats import wilson_interval
from fira_train.run.peak_memory import env_prefix

#: The first words of a run's ``report.md``: a report.md that begins otherwise is not fine-tuning's.
REPORT_TITLE = "# Fine-tuning: "

#: How each scoring is described in a report.
PROTOCOL = {
    "loglik": "scored by the log-likelihood of each option (lm-eval's multiple-choice accuracy; acc_norm divides "
              "each option's log-likelihood by its length in characters)",
    "generate": "evaluated by greedy generation + answer extraction (LLM-Adapters protocol, case-insensitive)",
    "generate-released": "evaluated by greedy generation + case-sensitive answer extraction (the released "
                         "LLM-Adapters protocol, as runs made before --scoring existed were)",
}


def scoring_of(results: Mapping[str, Any]) -> str:
    """The run's scoring; ``generate-released`` for runs written before ``--scoring`` existed."""
    return results["config"].get("scoring", "generate-released")


def model_label(name: str) -> str:
    """How a report names the model: a hub id as it is, a local folder by its own name.

    A run on a local copy records the folder's full path; the title keeps only its last part so that
    a committed report does not carry the machine's directory layout (``results.json`` keeps the path).
    """
    local = PurePath(name).is_absolute() or name.startswith(".")
    return (PurePath(name).name or name) if local else name


def accuracy_cell(correct: int, n: int) -> str:
    """``"41.2 [37.0, 45.6]"``: the accuracy and its 95% Wilson interval, in %."""
    low, high = wilson_interval(correct, n)
    return f"{100 * correct / n:.1f} [{100 * low:.1f}, {100 * high:.1f}]"


def p_text(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def paired_cell(paired: Paired) -> str:
    """``"+3.2 (p 0.041)"``: B minus A in accuracy points and the exact McNemar p-value."""
    return f"{100 * paired.difference:+.1f} (p {p_text(paired.p_value)})"


@dataclass(frozen=True)
class TrainingSpan:
    """A run's training time and peak RSS as its reports show them."""

    seconds: float
    peak_rss_mib: float | None
    sittings: list[dict[str, Any]]
    """Every sitting, where the figures are their sums (the time) and highest (the peak); [] for
    a run trained in one sitting or whose earlier sittings were not recorded."""
    resumed_from_step: int | None
    """Where ``sittings`` is []: the checkpoint step the measured sitting began from (None: 0)."""
    steps: int
    """The run's steps."""

    @property
    def evaluated_only(self) -> bool:
        """The measured sitting trained nothing (resumed at the last step, earlier sittings not
        recorded): its figures are of loading and evaluating, not of training."""
        return not self.sittings and self.resumed_from_step is not None and self.resumed_from_step >= self.steps

    def scope(self) -> str:
        """What the figures cover where it is not the whole training in one sitting ("" there):
        ``"2 sittings"``, ``"steps 101-500 only"``, ``"resumed at step 500: evaluated only"``."""
        if self.sittings:
            return f"{len(self.sittings)} sittings"
        start = self.resumed_from_step
        if self.evaluated_only:
            return f"resumed at step {start}: evaluated only"
        return f"steps {start + 1}-{self.steps} only" if start else ""


def sitting_totals(sittings: list[dict[str, Any]] | None) -> tuple[float | None, float | None]:
    """Training seconds summed over the sittings and their highest peak RSS (MiB); None where
    the sittings, or a sitting's peak, are unknown. A sitting resumed at the last step (the
    earlier one stopped while evaluating) counts too: its checkpoint loading is part of the run."""
    if not sittings:
        return None, None
    peaks = [s.get("peak_rss_mib") for s in sittings]
    return sum(s["seconds"] for s in sittings), (None if None in peaks else max(peaks))


def training_span(results: dict[str, Any]) -> TrainingSpan:
    """The whole training's figures where every sitting was recorded (an evaluation-only sitting,
    resumed at the last step, adds its checkpoint loading), else the last sitting's."""
    training = results.get("training") or {}
    history = training.get("sittings") or []
    if len(history) > 1:  # the sum of every sitting's (the peak is the last sitting's; so was train_s in
        # a results.json written before it became the sum)
        seconds, peak = sitting_totals(history)
        return TrainingSpan(seconds, peak, history, None, results["config"]["steps"])
    return TrainingSpan(results["time"]["train_s"], results["memory"]["train_peak_rss_mib"], [],
                        training.get("resumed_from_step"), results["config"]["steps"])


def render_report(results: dict[str, Any]) -> str:
    """A Markdown summary of one run's ``results.json``."""
    config, memory, timing = results["config"], results["memory"], results["time"]
    span = training_span(results)
    rss = f"{span.peak_rss_mib:.0f}" if span.peak_rss_mib is not None and not span.evaluated_only else "-"
    train_s = "-" if span.evaluated_only else f"{span.seconds:.1f}s"
    # continued from a checkpoint without its earlier sittings recorded: the last sitting only
    resumed = f" ({span.scope()}; the peak RSS too)" if span.resumed_from_step else ""
    if span.sittings:
        resumed = " in {} sittings ({})".format(len(span.sittings), ", ".join(
            f"steps {s['from_step'] + 1}-{s['to_step']} at {s['threads']} thread{'s' if s['threads'] != 1 else ''}"
            if s["to_step"] > s["from_step"] else "evaluated only" for s in span.sittings))
    scoring = scoring_of(results)
    loglik = scoring == "loglik"
    lines = [
        f"{REPORT_TITLE}{config['method']} on {model_label(results['model']['name'])}",
        "",
        (f"Trained on {', '.join(results['trained_on']) or '-'} ({results['train_records']} records, "
         f"{config['steps']} steps x {config['batch_size']}, lr {config['lr']}"
         # the method's own size (None where it has none): runs of a rank sweep differ only there
         f"{', rank ' + str(config['rank']) if config.get('rank') is not None else ''}"
         f"{', LoRA r ' + str(config['lora_r']) if config['method'] in LORA_METHODS else ''}"
         f"{', updates in the backward pass' if config.get('step_in_backward') else ''}"
         f"{', ' + config['precision'] + ' mixed precision' if config.get('precision') in ('bf16', 'fp16') else ''}"
         f"{', recipe ' + config['recipe'] if config.get('recipe') else ''})" if results["training"]
         else "Not trained (zero-shot)") + f"; {PROTOCOL[scoring]}. Accuracy in % with its 95% Wilson interval.",
        "",
        "| task | accuracy [95% CI] | correct / n | " + ("acc_norm [95% CI] |" if loglik else "unparsed |"),
        "|---|---|---|---|",
    ]
    for name, m in results["tasks"].items():
        last = accuracy_cell(m["correct_norm"], m["n"]) if loglik else str(m["unparsed"])
        lines.append(f"| {name} | {accuracy_cell(m['correct'], m['n'])} | {m['correct']} / {m['n']} | {last} |")
    norm = f" {100 * results['average_accuracy_norm']:.1f} |" if loglik else " |"
    lines.append(f"| **average** | **{100 * results['average_accuracy']:.1f}** | |{norm}")
    lines += [
        "",
        "The average is the plain mean of the task accuracies (no interval).",
        "",
    ]
    if results.get("validation"):
        lines += ["Validation (held-out training records; what a learning-rate sweep chooses on): " + ", ".join(
            f"{name} {accuracy_cell(m['correct'], m['n'])}" for name, m in results["validation"].items())
            + f"; average {100 * results['validation_accuracy']:.1f}.", ""]
    lines += [
        f"- optimizer state: {memory['optimizer_state_numel']:,} elements "
        f"({memory['optimizer_state_mib']:.1f} MiB {_state_storage(config)})",
        f"- trainable parameters: {results['model']['trainable_parameters']:,} of {results['model']['parameters']:,}",
        f"- peak RSS during training: {rss} MiB; process peak {memory['process_peak_rss_mib']:.0f} MiB"
        # over several sittings the training peak is the largest sitting's, the process's the last one's
        + (" (the last sitting's)" if len(span.sittings) > 1 else "")
        + (f" (with {env_prefix(memory['malloc_env']).strip()})" if memory.get("malloc_env") else ""),
        f"- time: load {timing['load_s']:.1f}s, train {train_s}{resumed}, eval {timing['eval_s']:.1f}s"
        + (" (validation included)" if results.get("validation") else ""),
    ]
    if results["training"]:
        t = results["training"]
        lines.append(f"- loss: first {t['loss_first']:.3f}, last-10% mean {t['loss_tail_mean']:.3f} ({t['optimizer']})")
    return "\n".join(lines) + "\n"


def render_comparison(
    runs: Mapping[str, Mapping[str, Any]],
    correctness: Mapping[str, Mapping[str, Mapping[int, bool]]] | None,
    *,
    tasks: Sequence[str],
    labels: Mapping[str, str] | None = None,
    short: Mapping[str, str] | None = None,
    baseline: str | None = None,
) -> list[str]:
    """Markdown lines: every run's per-task accuracy with 95% Wilson intervals, then every run
    against ``baseline`` (default: the first run) on the same examples, per task and pooled.

    ``runs``: run name -> ``results.json``; ``correctness``: run name -> ``{task: {index: correct}}``
    (:func:`fira_train.finetune.paired.load_correctness`; ``None``: no paired tests);
    ``labels``/``short``: display names of runs and tasks.
    """
    if not runs:
        return ["(no finished runs)"]
    labels = labels or {}
    short = short or {}
    names = list(runs)
    baseline = baseline if baseline is not None else names[0]
    if baseline not in runs:
        raise ValueError(f"baseline={baseline!r} is not one of the runs {names}")
    label = lambda name: labels.get(name, name)  # noqa: E731
    head = " | ".join(short.get(t, t) for t in tasks)
    lines = [f"| run | {head} | avg |", "|" + "---|" * (len(tasks) + 2)]
    for name in names:
        m = runs[name]["tasks"]
        cells = " | ".join(accuracy_cell(m[t]["correct"], m[t]["n"]) for t in tasks)
        average = sum(m[t]["accuracy"] for t in tasks) / len(tasks)
        lines.append(f"| {label(name)} | {cells} | **{100 * average:.1f}** |")
    lines += ["", "Accuracy in % [95% Wilson score interval]; avg: plain mean of the task accuracies.", ""]
    others = [n for n in names if n != baseline]
    if not others or correctness is None:
        return lines
    lines += [f"| run vs {label(baseline)} | {head} | all examples |", "|" + "---|" * (len(tasks) + 2)]
    for name in others:
        pairs = _by_task(correctness, baseline, name, tasks)
        cells = " | ".join(paired_cell(p) for p in pairs)
        lines.append(f"| {label(name)} | {cells} | {paired_cell(pool(pairs))} |")
    lines += [
        "",
        f"Paired on the same examples: accuracy of the run minus that of {label(baseline)}, in points, and the "
        f"two-sided exact McNemar p-value (binomial test of the examples only one of the two answers "
        f"correctly); 'all examples' pools the tasks, each example once. No correction for the number of "
        f"comparisons; a setting chosen on these test examples would make its row's p-value optimistic "
        f"(choose on validation records: `--max-val`).",
        "",
    ]
    return lines


def render_pairs(
    names: Sequence[str],
    correctness: Mapping[str, Mapping[str, Mapping[int, bool]]],
    *,
    tasks: Sequence[str],
    labels: Mapping[str, str] | None = None,
) -> list[str]:
    """Markdown lines: every pair of ``names`` (A before B in their order) on the same examples,
    all tasks pooled: B's accuracy minus A's and McNemar's exact p-value.

    Used for the methods' chosen runs, so that each method is compared with each other one and not
    only with a single baseline.
    """
    labels = labels or {}
    label = lambda name: labels.get(name, name)  # noqa: E731
    lines = ["| A | B | B minus A, all examples |", "|---|---|---|"]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pooled = pool(_by_task(correctness, a, b, tasks))
            lines.append(f"| {label(a)} | {label(b)} | {paired_cell(pooled)} |")
    return lines + [""]


def _by_task(correctness: Mapping[str, Mapping[str, Mapping[int, bool]]], a: str, b: str,
             tasks: Sequence[str]) -> list[Paired]:
    """Runs ``a`` and ``b`` paired on each task's examples."""
    return [compare(correctness[a][t], correctness[b][t], f"{a} and {b} on {t}") for t in tasks]


def _state_storage(config: dict[str, Any]) -> str:
    """How the optimizer states were stored (records from before the options: fp32, rounded to nearest)."""
    dtype = config.get("state_dtype") or "float32"
    stochastic = (config.get("state_rounding") or "nearest") == "stochastic"
    return "fp32" if dtype == "float32" else f"{dtype} states" + (", stochastically rounded" if stochastic else "")
