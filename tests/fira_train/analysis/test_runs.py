"""train_runs: parallel worker processes give the runs of one process, and reuse finds them."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
from dataclasses import replace
from pathlib import Path

import pytest

from fira_train.analysis.ablation import TITLE, ablation_runs
from fira_train.analysis.noise import noise_runs
from fira_train.analysis.runs import RUN_SPEC_FILE, train_runs
from fira_train.analysis.similarity import similarity_runs
from fira_train.analysis.spikes import spike_runs
from fira_train.run.metrics import read_metrics
from tests.fira_train.analysis.analysis_fixtures import analysis_config, corpus_root  # noqa: F401
from tests.fira_train.harness_fixtures import StopRun, stop_at_checkpoint


def test_every_analysis_run_can_be_sent_to_a_worker() -> None:
    runs = [*ablation_runs(["fira"], [1.1]), *noise_runs(["adamw"], 1e-3, 0), *spike_runs(["fira"]),
            *similarity_runs([4], every=1, columns=3, seed=0)]
    for run in runs:
        assert pickle.loads(pickle.dumps(run)).spec() == run.spec()


def test_jobs_give_the_runs_of_one_process_and_reuse_keeps_them(tmp_path: Path, corpus_root: Path, caplog) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=3")
    # a plain run and one whose callbacks (a functools.partial) change the optimizer's gamma
    runs = ablation_runs(["fira-no-limiter"], [1.1])
    serial = train_runs(config, runs, tmp_path / "serial", title=TITLE)
    parallel = train_runs(config, runs, tmp_path / "parallel", jobs=2, title=TITLE)
    assert list(parallel) == [r.name for r in runs]
    for run in runs:
        # one thread per run either way (micro_config sets train.num_threads=1): bit for bit
        assert parallel[run.name]["val_ppl"] == serial[run.name]["val_ppl"]
        assert ([m["loss"] for m in read_metrics(tmp_path / "parallel" / run.name)]
                == [m["loss"] for m in read_metrics(tmp_path / "serial" / run.name)])
        spec = json.loads((tmp_path / "parallel" / run.name / RUN_SPEC_FILE).read_text())
        assert spec == run.spec()
    assert serial["fira-gamma1.1"]["val_ppl"] != serial["fira-no-limiter"]["val_ppl"]

    metrics = tmp_path / "parallel" / "fira-gamma1.1" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    again = train_runs(config, runs, tmp_path / "parallel", reuse=True, jobs=2, title=TITLE)
    assert again == parallel and metrics.stat().st_mtime_ns == before
    # a finished run of another config: refused, not deleted (it was retrained without a word)
    shorter = analysis_config(corpus_root, tmp_path / "run", "train.steps=2")
    with pytest.raises(FileExistsError, match="holds a finished run made with another config: --reuse keeps"):
        train_runs(shorter, runs, tmp_path / "parallel", reuse=True, title=TITLE)
    assert metrics.stat().st_mtime_ns == before
    # stopped between writing its summary and its spec: unfinished, trained again (it was refused
    # as "another config", and the advised --overwrite retrained every run)
    (tmp_path / "parallel" / "fira-no-limiter" / RUN_SPEC_FILE).unlink()
    other = tmp_path / "parallel" / "fira-no-limiter" / "metrics.jsonl"
    other_before = other.stat().st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="fira_train.analysis.runs"):
        redone = train_runs(config, runs, tmp_path / "parallel", reuse=True, title=TITLE)
    assert f"{tmp_path / 'parallel' / 'fira-no-limiter'} holds a finished run without its {RUN_SPEC_FILE}" in caplog.text
    assert {k: v["val_ppl"] for k, v in redone.items()} == {k: v["val_ppl"] for k, v in parallel.items()}
    assert other.stat().st_mtime_ns != other_before and metrics.stat().st_mtime_ns == before
    # a finished run of this config on a corpus that changed since: refused too, not kept
    summary_path = tmp_path / "parallel" / "fira-gamma1.1" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary_path.write_text(json.dumps({**summary, "data": {**summary["data"], "token_digest": "f" * 32}}))
    with pytest.raises(ValueError, match="trained on other data"):
        train_runs(config, runs, tmp_path / "parallel", reuse=True, title=TITLE)
    assert metrics.stat().st_mtime_ns == before


def test_reuse_continues_an_unfinished_run_exactly_callbacks_included(tmp_path: Path, corpus_root: Path,
                                                                     monkeypatch, caplog) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=6", "train.save_every=2")
    # gradient noise (a random generator) and full-rank shadow moments: state carried step to step
    runs = [*noise_runs(["fira"], 1e-3, 0)[1:], *similarity_runs([4], every=1, columns=3, seed=0)]
    straight = train_runs(config, runs, tmp_path / "straight", title="Noise")

    # each run stopped once before saving step 6: steps 5-6 ran after the newest checkpoint (4)
    stop_at_checkpoint(monkeypatch, 6, saved=False, once_per_run=True)
    out = tmp_path / "stopped"
    with pytest.raises(StopRun):
        train_runs(config, runs, out, title="Noise")
    norms = out / runs[0].name / "norms.jsonl"
    with open(norms, "a", encoding="utf-8") as f:
        f.write('{"step": 7, "lo')  # a line cut by the kill
    with pytest.raises(StopRun), caplog.at_level(logging.INFO, logger="fira_train.analysis.runs"):
        train_runs(config, runs, out, reuse=True, title="Noise")  # the first continues, the second stops
    assert f"{out / runs[0].name}: continuing from its newest checkpoint" in caplog.text
    resumed = train_runs(config, runs, out, reuse=True, title="Noise")

    for run, recorded in zip(runs, ["norms.jsonl", "scaling_factors.jsonl"]):
        assert resumed[run.name]["sittings"] == 2 and straight[run.name]["sittings"] == 1
        assert resumed[run.name]["val_loss"] == straight[run.name]["val_loss"]  # bit for bit
        assert ((out / run.name / recorded).read_text()
                == (tmp_path / "straight" / run.name / recorded).read_text())
        assert [m["loss"] for m in read_metrics(out / run.name)] == [
            m["loss"] for m in read_metrics(tmp_path / "straight" / run.name)]


def test_reuse_starts_again_an_unfinished_run_of_another_spec(tmp_path: Path, corpus_root: Path,
                                                             monkeypatch, caplog) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=4", "train.save_every=2")
    runs = ablation_runs(["fira"], [])
    go_on = stop_at_checkpoint(monkeypatch, 4, saved=False)
    with pytest.raises(StopRun):
        train_runs(config, runs, tmp_path / "out", title=TITLE)
    go_on()
    spec = tmp_path / "out" / "fira" / RUN_SPEC_FILE
    assert json.loads(spec.read_text()) == runs[0].spec()  # written when the run started
    spec.write_text(json.dumps({**runs[0].spec(), "callbacks": "something else"}))
    with caplog.at_level(logging.WARNING, logger="fira_train.analysis.runs"):
        summary = train_runs(config, runs, tmp_path / "out", reuse=True, title=TITLE)["fira"]
    assert summary["sittings"] == 1  # from its start, not from the checkpoint of step 2
    assert json.loads(spec.read_text()) == runs[0].spec()
    assert "holds an unfinished run that --reuse cannot continue (it was started with other callbacks" in caplog.text
    # stopped again, then asked for more steps: the config changed, and the warning says how
    go_on = stop_at_checkpoint(monkeypatch, 4, saved=False)
    (tmp_path / "out" / "fira" / "summary.json").unlink()
    longer = analysis_config(corpus_root, tmp_path / "run", "train.steps=6", "train.save_every=2")
    caplog.clear()
    with pytest.raises(StopRun), caplog.at_level(logging.WARNING, logger="fira_train.analysis.runs"):
        train_runs(longer, runs, tmp_path / "out", reuse=True, title=TITLE)
    assert "it has train.steps=4 (now 6)" in caplog.text
    # a memory lever is what a resume may change: continued from its checkpoint, not from its start
    go_on()
    lever = analysis_config(corpus_root, tmp_path / "run", "train.steps=6", "train.save_every=2",
                            "train.activation_checkpointing=true")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fira_train.analysis.runs"):
        summary = train_runs(lever, runs, tmp_path / "out", reuse=True, title=TITLE)["fira"]
    assert "cannot continue" not in caplog.text and summary["sittings"] == 2
    # stopped after its last checkpoint (while evaluating): nothing would train with the other
    # setting, so the run is trained again from its start, not refused
    (tmp_path / "out" / "fira" / "summary.json").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fira_train.analysis.runs"):
        summary = train_runs(longer, runs, tmp_path / "out", reuse=True, title=TITLE)["fira"]
    assert ("it has a checkpoint its resume refuses (cannot resume from step_00000006 with "
            "train.activation_checkpointing=True (now False): it is the run's last step") in caplog.text
    assert summary["sittings"] == 1
    # so too another optim.implementation (a resume from the last step refuses it: resume_check)
    (tmp_path / "out" / "fira" / "summary.json").unlink()
    other = analysis_config(corpus_root, tmp_path / "run", "train.steps=6", "train.save_every=2",
                            "optim.implementation=reference")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fira_train.analysis.runs"):
        summary = train_runs(other, runs, tmp_path / "out", reuse=True, title=TITLE)["fira"]
    assert ("it has a checkpoint its resume refuses (cannot resume from step_00000006 with "
            "optim.implementation='fast' (now 'reference'): it is the run's last step") in caplog.text
    assert summary["sittings"] == 1


def test_a_second_analysis_into_a_busy_run_folder_leaves_its_spec_alone(tmp_path: Path, corpus_root: Path) -> None:
    from fira_train.analysis.runs import AnalysisRun
    from fira_train.run.run_lock import RunDirectoryBusy, locked_run_directory

    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=2")
    train_runs(config, [AnalysisRun("fira", "fira", describe="first")], tmp_path / "out", title=TITLE)
    spec = tmp_path / "out" / "fira" / RUN_SPEC_FILE
    before = spec.read_text()
    with locked_run_directory(tmp_path / "out" / "fira"):  # a run still training there
        with pytest.raises(RunDirectoryBusy):
            train_runs(config, [AnalysisRun("fira", "fira", describe="second")], tmp_path / "out", title=TITLE,
                       overwrite=True)
    assert spec.read_text() == before  # it was rewritten before the lock refused the second one


def test_a_failing_worker_run_raises_and_keeps_the_finished_runs(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=2")
    runs = ablation_runs(["fira"], [])
    out = tmp_path / "out"
    out.mkdir()
    (out / "fira").write_text("")  # a file where the run's folder goes: its worker fails
    with pytest.raises(OSError):
        train_runs(config, [*runs, *ablation_runs(["fira-matrix"], [])], out, jobs=2, title=TITLE)
    assert (out / "fira-matrix" / "summary.json").exists()


def test_a_run_in_the_way_is_refused_before_anything_trains(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=2")
    runs = ablation_runs(["fira-matrix", "fira"], [])
    out = tmp_path / "out"
    (out / "fira").mkdir(parents=True)
    (out / "fira" / "summary.json").write_text("{}")  # neither reuse nor overwrite
    with pytest.raises(FileExistsError, match="already holds a run .*--reuse .*--overwrite"):
        train_runs(config, runs, out, title=TITLE)
    assert not (out / "fira-matrix").exists()
    with pytest.raises(ValueError, match="--reuse keeps .* --overwrite redoes"):
        train_runs(config, runs, out, reuse=True, overwrite=True, title=TITLE)


def test_a_setting_the_runs_replace_is_refused(tmp_path: Path, corpus_root: Path) -> None:
    from fira_train.analysis.gap_sweep import gap_sweep_runs
    from fira_train.analysis.rank_sweep import rank_sweep_runs
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import get_recipe

    config = analysis_config(corpus_root, tmp_path / "run", "train.steps=2")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="optim.rank=8 would be replaced.*'fira-r4': 4"):
        train_runs(apply_overrides(config, ["optim.rank=8"]), rank_sweep_runs(["fira"], [4]), out, title=TITLE)
    with pytest.raises(ValueError, match="optim.update_proj_gap=7 would be replaced"):
        train_runs(apply_overrides(config, ["optim.update_proj_gap=7"]), gap_sweep_runs(["fira"], [3], [0]), out,
                   title=TITLE)
    with pytest.raises(ValueError, match="optim.method='adamw' would be replaced"):
        train_runs(apply_overrides(config, ["optim.method=adamw"]), ablation_runs(["fira"], []), out, title=TITLE)
    with pytest.raises(ValueError, match="train.seed=3 would be replaced"):
        train_runs(apply_overrides(config, ["train.seed=3"]), gap_sweep_runs(["fira"], [3], [0, 1]), out, title=TITLE)
    # what the caller gave is checked even where it equals the recipe's value, and named as given
    assert config.train.seed == get_recipe(config.recipe).train.seed
    with pytest.raises(ValueError, match="--seed 0 would be replaced: .*train.seed .*'fira-T3-s1': 1"):
        train_runs(config, gap_sweep_runs(["fira"], [3], [1, 2]), out, title=TITLE, given={"train.seed": "--seed 0"})
    with pytest.raises(ValueError, match="optim.rank=8 would be replaced"):
        train_runs(replace(apply_overrides(config, ["optim.rank=8"]), recipe="custom"), rank_sweep_runs(["fira"], [4]),
                   out, title=TITLE, given={"optim.rank": "optim.rank=8"})
    assert not out.exists()
    # the value the runs set anyway, a key some runs leave to the config, a config of no recipe: accepted
    seeded = apply_overrides(config, ["train.seed=3", "optim.rank=8"])
    assert set(train_runs(seeded, gap_sweep_runs(["fira"], [2], [3]), out, title=TITLE)) == {"fira-T2"}
    assert set(train_runs(seeded, spike_runs(["fira", "galore"], {"galore": 4}), out / "s", title=TITLE,
                          partly_set=("optim.rank",))) == {"fira", "galore"}
    custom = replace(apply_overrides(config, ["optim.rank=8"]), recipe="custom")
    assert set(train_runs(custom, rank_sweep_runs(["fira"], [4]), out / "c", title=TITLE)) == {"adamw", "fira-r4"}


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_bad_jobs_name_the_argument(jobs, tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run")
    with pytest.raises(ValueError, match="jobs"):
        train_runs(config, ablation_runs(["fira"], []), tmp_path / "out", jobs=jobs, title=TITLE)


def test_an_analysis_leaves_a_report_it_did_not_write_alone(tmp_path: Path, corpus_root: Path) -> None:
    config = analysis_config(corpus_root, tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("# My notes\n")
    with pytest.raises(FileExistsError, match=re.escape(f"report.md that this analysis ({TITLE!r}) did not write "
                                                        "(it begins '# My notes") + ".*--overwrite"):
        train_runs(config, ablation_runs(["fira"], []), out, reuse=True, title=TITLE)
    assert not (out / "fira").exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_analysis_refuses_a_sweeps_or_a_comparisons_folder_without_offering_overwrite(
        tmp_path: Path, corpus_root: Path, overwrite: bool) -> None:
    """Another command's results (a sweep: its report, or its sweep.json alone; a comparison) are
    not the analysis's to replace: refused, --overwrite or not, and a fresh --out suggested (the
    error had offered --overwrite, which replaced the sweep's report and mixed the runs)."""
    config = analysis_config(corpus_root, tmp_path / "run")
    for name, files in [("sweep", {"report.md": "# Learning-rate sweep: recipe `tiny`\n", "sweep.json": "{}"}),
                        ("record", {"sweep.json": "{}"}),
                        ("compare", {"report.md": "# Pre-training comparison: recipe `tiny`\n"})]:
        out = tmp_path / name
        out.mkdir()
        for file, text in files.items():
            (out / file).write_text(text)
        what = "a comparison" if name == "compare" else "a sweep"
        with pytest.raises(FileExistsError, match=f"holds {what} .*another command's results.*choose a fresh --out$"):
            train_runs(config, ablation_runs(["fira"], []), out, overwrite=overwrite, title=TITLE)
        assert sorted(p.name for p in out.iterdir()) == sorted(files)  # nothing written


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_analysis_refuses_another_analysis_folder_overwrite_or_not(tmp_path: Path, corpus_root: Path,
                                                                      overwrite: bool) -> None:
    """--overwrite replaced another analysis's report.md and left its runs and figure beside the
    new ones, in a folder that was neither's; a report of the user's is still replaced."""
    config = analysis_config(corpus_root, tmp_path / "run")
    for command in ("`fira-train analyze gap-sweep --out x`", "(called from Python)"):
        out = tmp_path / "gap"
        out.mkdir(exist_ok=True)
        (out / "report.md").write_text(f"# Validation perplexity under varying update gaps\n\n- Command: {command}\n")
        with pytest.raises(FileExistsError, match=r"holds another analysis's results \('Validation perplexity under "
                                                  r"varying update gaps'\).*choose a fresh --out$"):
            train_runs(config, ablation_runs(["fira"], []), out, overwrite=overwrite, title=TITLE)
        assert sorted(p.name for p in out.iterdir()) == ["report.md"]  # nothing written


def test_step_records_must_cover_every_step_that_updated(tmp_path: Path) -> None:
    """One record per step 1..S, but those an fp16 run skipped (summary.json's skipped_steps)."""
    from fira_train.analysis.runs import read_step_records
    from fira_train.files import DamagedFileError

    path = tmp_path / "norms.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 4)))
    assert len(read_step_records(path, {"steps": 4, "skipped_steps": 1})) == 3
    for summary in ({"steps": 4}, {"steps": 3, "skipped_steps": 0}):
        with pytest.raises(DamagedFileError, match=r"norms.jsonl is damaged \(3 records \(steps 1\.\.4\)"):
            read_step_records(path, summary)
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (2, 1)))
    with pytest.raises(DamagedFileError, match="2 records"):
        read_step_records(path, {"steps": 2})
    path.write_text("[1, 2]\n")
    with pytest.raises(DamagedFileError, match="record 1 is not a step's record"):
        read_step_records(path, {"steps": 1})


def test_an_analysis_record_file_writes_null_for_a_value_that_is_not_finite(tmp_path: Path) -> None:
    """norms.jsonl held NaN and Infinity, which are not JSON, where metrics.jsonl writes null; the
    analyses read null back as NaN, as they read NaN before."""
    import json
    import math

    from fira_train.analysis.runs import JsonlWriter, read_step_records

    path = tmp_path / "norms.jsonl"
    writer = JsonlWriter(path)
    writer.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "column": {"w": [1.0, float("-inf")]}})
    writer.write({"step": 2, "loss": 2.5, "grad_norm": 1.0})
    lines = path.read_text().splitlines()
    assert lines[0] == '{"step": 1, "loss": null, "grad_norm": null, "column": {"w": [1.0, null]}}'

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    assert [json.loads(line, parse_constant=refuse)["step"] for line in lines] == [1, 2]
    first, second = read_step_records(path, {"steps": 2})
    assert math.isnan(first["loss"]) and math.isnan(first["grad_norm"]) and math.isnan(first["column"]["w"][1])
    assert second == {"step": 2, "loss": 2.5, "grad_norm": 1.0}


@pytest.mark.timeout(60)  # a FIFO opened for writing blocks until a reader comes
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_an_analysis_record_file_is_appended_to_only_as_a_regular_file(tmp_path: Path) -> None:
    """As metrics.jsonl: a link or a FIFO put in its place while the run trains is refused, not
    written through (a FIFO blocked the write until a reader came)."""
    from fira_train.analysis.runs import JsonlWriter

    path = tmp_path / "norms.jsonl"
    writer = JsonlWriter(path)
    writer.write({"step": 1})
    assert path.read_text() == '{"step": 1}\n'
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(ValueError, match="is not a file"):
        writer.write({"step": 2})
    path.unlink()
    (tmp_path / "elsewhere").write_text("")
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        writer.write({"step": 2})
    assert (tmp_path / "elsewhere").read_text() == ""


def test_a_table_keeps_four_significant_digits_trailing_zeros_included() -> None:
    """Plain "g" dropped them: 112.0 read "112" beside "110.9", 299.97 "300", the paper's 32.90
    "32.9", a ratio of 1.000 "1", as if each were rounded more coarsely than the others."""
    from fira_train.analysis.runs import markdown_table

    table = markdown_table(["run", "a", "b", "c", "d", "e"], [["x", 112.0, 110.94, 299.97, 32.9, 1.0],
                                                             ["y", 1234.4, -0.006846, 1e-05, 3, "-"]])
    assert table.splitlines()[2:] == ["| x | 112.0 | 110.9 | 300.0 | 32.90 | 1.000 |",
                                      "| y | 1234 | -0.006846 | 1.000e-05 | 3 | - |"]


def test_a_runs_progress_line_says_what_sets_it_apart(tmp_path: Path, corpus_root: Path, monkeypatch,  # noqa: F811
                                                     caplog) -> None:
    """The noisy run's line read "adamw-noise (adamw ) -> ...", as the clean run's did: the noise
    (and an ablation's gamma), set by the run's callbacks, was not named."""
    from fira_train.analysis import runs as runs_module

    monkeypatch.setattr(runs_module, "train", lambda *args, **kwargs: {"val_ppl": 100.0})
    clean, noisy = noise_runs(["adamw"], 1e-5, 0)
    config = analysis_config(corpus_root, tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="fira_train.analysis.runs"):
        for index, run in enumerate((clean, noisy), 1):
            cfg = runs_module.run_config(config, run, tmp_path / "out")
            runs_module._train_one(index, 2, run, cfg, "new", corpus=object())
    lines = [line for line in caplog.text.splitlines() if " -> " in line]
    assert "[1/2] adamw (adamw; NormRecorder) -> " in lines[0]
    assert "[2/2] adamw-noise (adamw; NormRecorder, GradientNoise(scale=1e-05, seed=0" in lines[1]
