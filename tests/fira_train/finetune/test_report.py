"""fira_train.finetune.report: one run's report and the comparison of runs (intervals, paired tests)."""

from __future__ import annotations

import pytest

from fira_train.finetune.paired import Paired
from fira_train.finetune.report import (
    accuracy_cell,
    model_label,
    paired_cell,
    render_comparison,
    render_pairs,
    render_report,
)
from fira_train.finetune.stats import mcnemar_exact, wilson_interval


def results(correct: dict[str, int], n: int = 10, scoring: str | None = "loglik") -> dict:
    tasks = {t: {"accuracy": c / n, "correct": c, "n": n, "accuracy_norm": c / n, "correct_norm": c,
                 "unparsed": 0, "seconds": 1.0} for t, c in correct.items()}
    config = {"method": "fira", "steps": 3, "batch_size": 2, "lr": 1e-4}
    if scoring:
        config["scoring"] = scoring
    average = sum(m["accuracy"] for m in tasks.values()) / len(tasks)
    return {"config": config, "tasks": tasks, "average_accuracy": average, "average_accuracy_norm": average,
            "trained_on": ["boolq"], "train_records": 6, "training": None, "model": {"name": "tiny", "parameters": 10,
            "trainable_parameters": 0}, "time": {"load_s": 0.0, "train_s": 0.0, "eval_s": 1.0},
            "memory": {"optimizer_state_numel": 0, "optimizer_state_mib": 0.0, "train_peak_rss_mib": None,
                       "process_peak_rss_mib": 100.0}}


def test_cells():
    low, high = wilson_interval(3, 10)
    assert accuracy_cell(3, 10) == f"30.0 [{100 * low:.1f}, {100 * high:.1f}]"
    assert paired_cell(Paired(n=20, both=5, only_a=1, only_b=7, neither=7)) == \
        f"+30.0 (p {mcnemar_exact(1, 7):.3f})"
    assert paired_cell(Paired(n=200, both=0, only_a=0, only_b=30, neither=170)).endswith("(p <0.001)")


def test_single_run_report_names_protocol_and_intervals():
    text = render_report(results({"boolq": 7, "piqa": 4}))
    assert "log-likelihood of each option" in text and "95% Wilson interval" in text
    assert f"| boolq | {accuracy_cell(7, 10)} | 7 / 10 | {accuracy_cell(7, 10)} |" in text
    old = render_report(results({"boolq": 7}, scoring=None))  # a run made before --scoring: generated, case-sensitive
    assert "case-sensitive" in old and "| unparsed |" in old
    assert "process peak 100 MiB\n" in text  # glibc's defaults
    returned = results({"boolq": 7})
    returned["memory"]["malloc_env"] = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    assert "process peak 100 MiB (with MALLOC_MMAP_THRESHOLD_=131072)\n" in render_report(returned)


def test_the_optimizer_state_line_says_how_the_states_were_stored():
    def line(**config):
        returned = results({"boolq": 7})
        returned["config"].update(config)
        return next(t for t in render_report(returned).splitlines() if t.startswith("- optimizer state:"))

    assert line().endswith("(0.0 MiB fp32)")  # a record from before the options
    assert line(state_dtype="bfloat16", state_rounding="nearest").endswith("(0.0 MiB bfloat16 states)")
    assert line(state_dtype="bfloat16", state_rounding="stochastic").endswith(
        "(0.0 MiB bfloat16 states, stochastically rounded)")


def test_title_names_a_local_model_by_its_folder_and_a_hub_model_by_its_id():
    assert model_label("/work/cache/smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert model_label("./runs/model") == "model" and model_label(".") == "."
    assert model_label("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    local = results({"boolq": 7})
    local["model"]["name"] = "/home/me/cache/smollm2"
    assert render_report(local).startswith("# Fine-tuning: fira on smollm2\n")
    assert "Not trained (zero-shot); scored by" in render_report(local)  # the helper's run has no training
    local["training"] = {"loss_first": 3.0, "loss_tail_mean": 2.0, "optimizer": "FiraAdamW"}
    assert "Trained on boolq (6 records, 3 steps x 2, lr 0.0001); scored by" in render_report(local)


def test_the_training_line_names_the_rank_and_the_lora_r_a_method_trains_with():
    """Two runs of a rank sweep wrote the same report.md: the rank was in results.json only."""
    def trained(**config):
        returned = results({"boolq": 7})
        returned["training"] = {"loss_first": 3.0, "loss_tail_mean": 2.0, "optimizer": "FiraAdamW"}
        returned["config"].update(config)
        return next(t for t in render_report(returned).splitlines() if t.startswith("Trained on"))

    assert "lr 0.0001, rank 8)" in trained(rank=8, lora_r=None)
    assert "lr 0.0001, rank 16, LoRA r 32)" in trained(method="fira-lora", rank=16, lora_r=32)
    assert "lr 0.0001)" in trained(method="adamw", rank=None, lora_r=None)  # no rank of its own
    assert "lr 0.0001)" in trained()  # a record from before the options
    assert "lr 0.0001)" in trained(method="adamw", rank=None, lora_r=32)  # ... which kept every method's lora_r


def test_comparison_pairs_every_run_with_the_baseline():
    runs = {"a": results({"boolq": 2, "piqa": 1}), "b": results({"boolq": 3, "piqa": 1})}
    a = {"boolq": {0: True, 1: True, 2: False}, "piqa": {5: True, 6: False}}
    b = {"boolq": {0: True, 1: False, 2: True}, "piqa": {5: True, 6: False}}
    lines = "\n".join(render_comparison(runs, {"a": a, "b": b}, tasks=["boolq", "piqa"], labels={"b": "B"},
                                        short={"boolq": "BoolQ"}, baseline="a"))
    assert "| run | BoolQ | piqa | avg |" in lines and "| run vs a | BoolQ | piqa | all examples |" in lines
    # boolq: one example only a gets, one only b gets: +0.0, p 1; pooled over 5 examples the same
    assert "| B | +0.0 (p 1.000) | +0.0 (p 1.000) | +0.0 (p 1.000) |" in lines
    assert "McNemar" in lines and "Wilson" in lines
    assert "run vs" not in "\n".join(render_comparison(runs, None, tasks=["boolq", "piqa"]))
    with pytest.raises(ValueError, match="baseline='c' is not one of the runs"):
        render_comparison(runs, {"a": a, "b": b}, tasks=["boolq"], baseline="c")
    b["piqa"] = {5: True, 7: False}
    with pytest.raises(ValueError, match="a and b on piqa scored different examples"):
        render_comparison(runs, {"a": a, "b": b}, tasks=["boolq", "piqa"])


def test_pairs_compare_every_run_with_every_later_one_pooled_over_tasks():
    a = {"boolq": {0: True, 1: True, 2: False}, "piqa": {5: True, 6: False}}
    b = {"boolq": {0: True, 1: False, 2: True}, "piqa": {5: True, 6: True}}
    c = {"boolq": {0: False, 1: False, 2: False}, "piqa": {5: False, 6: False}}
    lines = render_pairs(["a", "b", "c"], {"a": a, "b": b, "c": c}, tasks=["boolq", "piqa"], labels={"a": "A"})
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| A | B")]
    assert [row.split(" | ")[:2] for row in rows] == [["| A", "b"], ["| A", "c"], ["| b", "c"]]
    # a -> b: two examples won (boolq 2, piqa 6), one lost (boolq 1): net +1 of 5, +20 points
    assert rows[0].endswith(f"| {paired_cell(Paired(n=5, both=2, only_a=1, only_b=2, neither=0))} |")
    assert "+20.0" in rows[0] and "-60.0" in rows[1] and "-80.0" in rows[2]


@pytest.mark.parametrize(("resumed", "time_line", "rss_line"), [
    (None, "train 5.0s, eval", "during training: 900 MiB"),
    (1, "train 5.0s (steps 2-3 only; the peak RSS too), eval", "during training: 900 MiB"),
    # resumed at the last step, earlier sittings unrecorded: nothing trained in the measured sitting
    (3, "train - (resumed at step 3: evaluated only; the peak RSS too), eval", "during training: - MiB"),
])
def test_report_says_which_sitting_its_training_figures_cover(resumed, time_line: str, rss_line: str):
    run = results({"boolq": 7})
    run["training"] = {"loss_first": 3.0, "loss_tail_mean": 2.0, "optimizer": "FiraAdamW", "resumed_from_step": resumed}
    run["time"]["train_s"], run["memory"]["train_peak_rss_mib"] = 5.0, 900.0
    text = render_report(run)
    assert time_line in text and rss_line in text


def test_over_two_sittings_the_process_peak_is_said_to_be_the_last_ones():
    """The training peak of a run in two sittings is the larger sitting's, the process peak only the
    last one's: 'peak RSS during training 2331 MiB; process peak 2298 MiB' read as a contradiction."""
    run = results({"boolq": 7})
    sittings = [{"from_step": 0, "to_step": 4, "seconds": 3.0, "peak_rss_mib": 2331.0, "threads": 2},
                {"from_step": 4, "to_step": 6, "seconds": 2.0, "peak_rss_mib": 2290.0, "threads": 2}]
    run["training"] = {"loss_first": 3.0, "loss_tail_mean": 2.0, "optimizer": "FiraAdamW", "resumed_from_step": 4,
                       "sittings": sittings}
    run["config"]["steps"] = 6
    run["time"]["train_s"], run["memory"]["train_peak_rss_mib"] = 2.0, 2290.0
    run["memory"]["process_peak_rss_mib"] = 2298.0
    text = render_report(run)
    assert "peak RSS during training: 2331 MiB; process peak 2298 MiB (the last sitting's)" in text
    run["training"]["sittings"] = None
    assert "(the last sitting's)" not in render_report(run)


def test_the_committed_benchmark_runs_reports_are_what_their_results_give():
    """docs/results/finetune/methods/*/report.md: rendered from the run's own results.json."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "docs" / "results" / "finetune" / "methods"
    runs = [d for d in sorted(root.iterdir()) if (d / "results.json").is_file()] if root.is_dir() else []
    if not runs:
        pytest.skip("no committed fine-tuning runs")
    for run in runs:
        assert (run / "report.md").read_text() == render_report(json.loads((run / "results.json").read_text())), run.name
