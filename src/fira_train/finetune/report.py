"""The Markdown summary (``report.md``) of one fine-tuning run's ``results.json``."""

from __future__ import annotations

from typing import Any


def render_report(results: dict[str, Any]) -> str:
    """A Markdown summary of one run's ``results.json``."""
    config, memory, timing = results["config"], results["memory"], results["time"]
    lines = [
        f"# Fine-tuning: {config['method']} on {results['model']['name']}",
        "",
        f"Trained on {', '.join(results['trained_on']) or '-'} ({results['train_records']} records, "
        f"{config['steps'] if results['training'] else 0} steps x {config['batch_size']}, lr {config['lr']}); "
        f"evaluated by greedy generation + answer extraction (LLM-Adapters protocol).",
        "",
        "| task | accuracy | correct / n | unparsed |",
        "|---|---|---|---|",
    ]
    for name, m in results["tasks"].items():
        lines.append(f"| {name} | {100 * m['accuracy']:.1f} | {m['correct']} / {m['n']} | {m['unparsed']} |")
    lines.append(f"| **average** | **{100 * results['average_accuracy']:.1f}** | | |")
    lines += [
        "",
        f"- optimizer state: {memory['optimizer_state_numel']:,} elements ({memory['optimizer_state_mib']:.1f} MiB fp32)",
        f"- trainable parameters: {results['model']['trainable_parameters']:,} of {results['model']['parameters']:,}",
        f"- peak RSS during training: {memory['train_peak_rss_mib']} MiB; process peak {memory['process_peak_rss_mib']:.0f} MiB",
        f"- time: load {timing['load_s']:.1f}s, train {timing['train_s']:.1f}s, eval {timing['eval_s']:.1f}s",
    ]
    if results["training"]:
        t = results["training"]
        lines.append(f"- loss: first {t['loss_first']:.3f}, last-10% mean {t['loss_tail_mean']:.3f} ({t['optimizer']})")
    return "\n".join(lines) + "\n"
