"""report.md and loss.png from run directories."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fira_train.report.markdown import load_run, report_table, write_report
from fira_train.report.plots import plot_curves


def _summary(method: str, rank: int | None, ppl: float, tps: float) -> dict:
    return {"recipe": "micro", "method": method, "rank": rank, "update_proj_gap": 5, "lr": 0.01,
            "steps": 4, "tokens": 1024, "seed": 0, "parameters": 123456, "trainable_parameters": 123456,
            "val_loss": math.log(ppl), "val_ppl": ppl, "val_tokens": 248, "tokens_per_s": tps,
            "train_time_s": 90.0, "wall_time_s": 100.0, "optimizer_state_numel": 250_000,
            "optimizer_state_bytes": 1_000_000, "peak_memory_bytes": 500 * 1024 ** 2,
            "peak_memory_kind": "process_peak_rss", "device": "cpu",
            "data": {"source": "wiki", "train_tokens": 5000, "val_tokens": 256, "tokenizer": "bpe"}}


def _write_run(root: Path, summary: dict) -> None:
    run = root / summary["method"]
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(summary))
    lines = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 0.01, "tokens_per_s": 1000.0} for s in range(1, 5)]
    lines[1].update(val_loss=4.9, val_ppl=math.exp(4.9))
    lines[3].update(val_loss=summary["val_loss"], val_ppl=summary["val_ppl"])
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_table_has_a_row_per_method_and_relative_throughput() -> None:
    table = report_table([_summary("fira", 32, 100.0, 970.0), _summary("adamw", None, 110.0, 1000.0)])
    lines = table.splitlines()
    assert lines[0].startswith("| Method | Rank |") and "Val. PPL" in lines[0] and "Peak memory" in lines[0]
    assert len(lines) == 4
    fira, adamw = lines[2].split("|"), lines[3].split("|")
    assert fira[1].strip() == "fira" and fira[2].strip() == "32" and fira[6].strip() == "100.00"
    assert fira[8].strip() == "97.0%"
    assert adamw[2].strip() == "-" and adamw[3].strip() == "-" and adamw[8].strip() == "100.0%"
    assert "0.25M (1.0 MiB)" in lines[2] and "500.0 MiB" in lines[2]
    assert "Test PPL" not in lines[0]  # runs without a test set


def test_train_time_is_in_minutes_and_under_a_minute_in_seconds() -> None:
    # a run of a few seconds (micro, a GPU) read "0.0 min", as if it took no time
    short, long = _summary("fira", 32, 100.0, 970.0), _summary("adamw", None, 110.0, 1000.0)
    short["train_time_s"] = 2.4
    lines = report_table([short, long]).splitlines()
    assert lines[2].endswith("| 2.4 s |") and lines[3].endswith("| 1.5 min |")


def test_vs_adamw_is_against_the_plain_adamw_run_where_there_is_one() -> None:
    runs = [_summary("adamw", None, 120.0, 200.0), _summary("adamw", None, 110.0, 1000.0)]
    lines = report_table(runs, ["adamw@optim.lr=0.003", "adamw"]).splitlines()
    assert lines[2].split("|")[8].strip() == "20.0%" and lines[3].split("|")[8].strip() == "100.0%"
    only_specs = report_table(runs, ["adamw@optim.lr=0.003", "adamw@optim.lr=0.01"]).splitlines()
    assert only_specs[2].split("|")[8].strip() == "100.0%"  # the first AdamW spec


def test_a_test_perplexity_column_follows_validation_when_runs_have_one() -> None:
    with_test = {**_summary("fira", 32, 100.0, 970.0), "test_ppl": 104.5}
    lines = report_table([with_test, _summary("adamw", None, 110.0, 1000.0)]).splitlines()
    assert "| Val. PPL | Test PPL |" in lines[0]
    assert lines[2].split("|")[7].strip() == "104.50" and lines[3].split("|")[7].strip() == "-"


def test_write_report_and_plot(tmp_path: Path) -> None:
    for summary in (_summary("fira", 32, 100.0, 970.0), _summary("galore", 32, 120.0, 990.0)):
        _write_run(tmp_path, {**summary, "code": {"source": "ab" * 8, "commit": None}})
    report = write_report(tmp_path, ["fira", "galore"], command="fira-train compare --recipe micro")
    text = report.read_text()
    assert f"Code: every run (2) was made by source `{'ab' * 8}`." in text
    assert report == tmp_path / "report.md"
    assert "| fira | 32 |" in text and "| galore | 32 |" in text
    assert "recipe `micro`" in text and "fira-train compare --recipe micro" in text
    assert "loss.png" in text and "(each run in a fresh process)" in text
    plot = plot_curves(tmp_path, ["fira", "galore"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_unfinished_run_is_reported_clearly(tmp_path: Path) -> None:
    (tmp_path / "fira").mkdir()
    with pytest.raises(FileNotFoundError, match="has not finished"):
        load_run(tmp_path / "fira")


def test_reports_cope_with_null_for_values_that_were_not_finite(tmp_path: Path) -> None:
    """metrics.jsonl / summary.json hold null where a value overflowed (fira_train.files)."""
    summary = _summary("fira", 32, 100.0, 970.0)
    _write_run(tmp_path, {**summary, "val_loss": None, "val_ppl": None})
    with open(tmp_path / "fira" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": None, "lr": 0.01, "val_loss": 800.0, "val_ppl": None}) + "\n")
    fira = report_table([load_run(tmp_path / "fira")[0]]).splitlines()[2].split("|")
    assert fira[5].strip() == "-" and fira[6].strip() == "-"
    assert "| fira | 32 |" in write_report(tmp_path, ["fira"]).read_text()
    assert plot_curves(tmp_path, ["fira"]).read_bytes()[:4] == b"\x89PNG"


def test_a_damaged_summary_is_named(tmp_path: Path) -> None:
    _write_run(tmp_path, _summary("fira", 32, 100.0, 970.0))
    (tmp_path / "fira" / "summary.json").write_text('{"method": "fira", ')
    with pytest.raises(ValueError, match=r"fira/summary\.json is damaged \(not valid JSON"):
        load_run(tmp_path / "fira")


def test_a_streamed_corpus_of_unknown_length_is_reported(tmp_path: Path) -> None:
    """C4 streams: its summary's train_tokens is null (formatting it raised a TypeError)."""
    for method in ("fira", "adamw"):
        summary = _summary(method, 32 if method == "fira" else None, 100.0, 970.0)
        summary["data"] = {**summary["data"], "source": "c4", "train_tokens": None}
        _write_run(tmp_path, summary)
    text = write_report(tmp_path, ["fira", "adamw"], command="fira-train compare").read_text()
    assert "data `c4` (streamed, tokenizer `bpe`)" in text


def test_under_torchrun_the_peak_memory_note_says_whose_peak_it_is(tmp_path: Path) -> None:
    for method in ("fira", "adamw"):
        _write_run(tmp_path, {**_summary(method, 32, 100.0, 970.0), "parallel": "ddp", "world_size": 2})
    text = write_report(tmp_path, ["fira", "adamw"]).read_text()
    assert "peak resident memory of the run's process on rank 0 of 2 processes (`--parallel ddp`)" in text
    assert "each run in a fresh process" not in text


def test_a_model_or_device_that_a_method_spec_changes_is_given_per_method(tmp_path: Path) -> None:
    """``fira@model.num_hidden_layers=2`` or ``@train.device=cpu`` changes one run's model or device:
    the heading gave the first run's as every method's."""
    _write_run(tmp_path, _summary("fira", 32, 100.0, 970.0))
    _write_run(tmp_path, {**_summary("adamw", None, 110.0, 1000.0), "parameters": 654_321, "device": "cuda:0"})
    heading = write_report(tmp_path, ["fira", "adamw"]).read_text().splitlines()[2]
    assert heading.endswith("model parameters by method: fira 0.12M, adamw 0.65M, "
                            "device by method: fira `cpu`, adamw `cuda:0`.")
    assert "model 0.12M parameters" not in heading


def test_the_peak_memory_note_names_each_run_s_kind_when_they_differ(tmp_path: Path) -> None:
    # a spec that moves one run to the GPU: its peak is CUDA's allocation, the other's the RSS
    _write_run(tmp_path, _summary("fira", 32, 100.0, 970.0))
    _write_run(tmp_path, {**_summary("adamw", None, 110.0, 1000.0), "peak_memory_kind": "cuda_max_allocated"})
    text = write_report(tmp_path, ["fira", "adamw"]).read_text()
    assert ("- Peak memory: by method: fira peak resident memory of the run's process, adamw CUDA "
            "max_memory_allocated (each run in a fresh process).") in text


def test_the_peak_memory_note_gives_each_run_s_launch_when_they_differ(tmp_path: Path) -> None:
    """`compare --parallel ddp` interrupted in its second run and resumed with `--parallel fsdp2`:
    the note said of both runs "on rank 0 of 2 processes (`--parallel ddp`)", the first run's
    launch, where the second's peak was measured under FSDP2 (its summary says so); a run of one
    process beside one of several was said to run in several processes, or the other way round."""
    _write_run(tmp_path, {**_summary("fira", 32, 100.0, 970.0), "parallel": "ddp", "world_size": 2})
    _write_run(tmp_path, {**_summary("adamw", None, 110.0, 1000.0), "parallel": "fsdp2", "world_size": 2})
    text = write_report(tmp_path, ["fira", "adamw"]).read_text()
    assert ("- Peak memory: peak resident memory of the run's process, launch by method: fira on rank 0 "
            "of 2 processes (`--parallel ddp`), adamw on rank 0 of 2 processes (`--parallel fsdp2`); the "
            "processes of a launch train its runs one after another, the peak reset for each run.") in text

    (tmp_path / "adamw" / "summary.json").write_text(json.dumps(_summary("adamw", None, 110.0, 1000.0)))
    text = write_report(tmp_path, ["fira", "adamw"]).read_text()
    assert ("launch by method: fira on rank 0 of 2 processes (`--parallel ddp`), adamw in a fresh "
            "process; the processes") in text
    assert "(each run in a fresh process)" not in text


def test_a_folder_it_cannot_read_is_no_analysis_run(tmp_path: Path, monkeypatch) -> None:
    """compare looks into every folder of its --out for an analysis's run (analysis_run.json): a
    folder the user cannot read (a mount point's root-only lost+found) raised PermissionError, and
    compare stopped with a traceback where it ran before. Such a folder holds no run of ours; an
    analysis's run beside it is still found."""
    import errno
    import pathlib

    from fira_train.files import ANALYSIS_RUN_FILE
    from fira_train.report.markdown import REPORT_TITLE, holds_analysis, refuse_other_commands_output

    out = tmp_path / "out"
    (out / "lost+found").mkdir(parents=True)
    stat = pathlib.Path.stat

    def denied(self, *args, **kwargs):  # as for a user other than root
        if self.parent.name == "lost+found":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return stat(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", denied)
    assert not holds_analysis(out)
    refuse_other_commands_output(out, own=REPORT_TITLE, writer="a comparison's", analyses=True)
    (out / "fira").mkdir()
    (out / "fira" / ANALYSIS_RUN_FILE).write_text("{}")
    assert holds_analysis(out)
