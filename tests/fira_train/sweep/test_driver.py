"""fira-train sweep: argument parsing, the choice on validation, and a micro sweep end to end
(its runs in this process: the spawn of each run is run_isolated's, tested with compare)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from fira_train.provenance import code_version, describe_change
from fira_train.run import checkpoint as ckpt
from fira_train.run import isolated
from fira_train.run.metrics import read_metrics
from fira_train.sweep import grid
from fira_train.sweep.driver import check_specs, parse_lr_grids, parse_numbers, rewrite_report, sweep
from fira_train.sweep.grid import RunKey, RunResult
from fira_train.sweep.stats import Spread
from fira_train.sweep.summary import choose_lr, summarize
from tests.fira_train.harness_fixtures import micro_config


def test_numbers_and_grids_are_checked_with_the_flag_and_value() -> None:
    assert parse_numbers("--seeds", "0, 1,2", int) == [0, 1, 2]
    for text, match in [("0.1,x", "'x' is not a number"), ("0.1,-1", "'-1' must be a positive"),
                        ("inf", "'inf' must be a positive finite number"),
                        ("0.1,0.1", "gives '0.1' twice"), ("0.1,1e-1", "gives 0.1 twice"), (" ", "at least one"),
                        ("0.1,,0.3", "empty entry"), ("0.1,", "empty entry")]:
        with pytest.raises(ValueError, match=match):
            parse_numbers("--lrs", text, float)
    with pytest.raises(ValueError, match="--seeds: '-1' must be >= 0"):
        parse_numbers("--seeds", "-1", int)
    specs = ["adamw", "fira@optim.alpha=0.5"]
    grids = parse_lr_grids(["0.01,0.001", "adamw:0.03,0.001"], specs)
    assert grids == {"adamw": [0.001, 0.03], "fira@optim.alpha=0.5": [0.001, 0.01]}
    assert parse_lr_grids(["fira@optim.alpha=0.5:0.1", "adamw:0.2"], specs)["fira@optim.alpha=0.5"] == [0.1]
    with pytest.raises(ValueError, match="no grid for fira@optim.alpha=0.5"):
        parse_lr_grids(["adamw:0.1"], specs)
    with pytest.raises(ValueError, match="'galore' is not among --methods"):
        parse_lr_grids(["galore:0.1"], specs)
    with pytest.raises(ValueError, match="two grids for every method"):
        parse_lr_grids(["0.1", "0.2"], specs)
    # every method has its own: the shared grid trained nothing, without a word
    with pytest.raises(ValueError, match=r"--lrs: the grid for every method \(0.1\) applies to none"):
        parse_lr_grids(["0.1", "adamw:0.2", "fira@optim.alpha=0.5:0.3"], specs)
    with pytest.raises(ValueError, match="method spec .* sets optim.lr: the sweep sets it itself"):
        check_specs(["fira@optim.lr=0.1"])


def _result(spec: str, lr: float, seed: int, val: float, test: float | None = None) -> tuple[RunKey, RunResult]:
    key = RunKey(spec, lr, seed)
    return key, RunResult(key, val, test, diverged=math.isinf(val))


def test_the_choice_uses_validation_only_and_flags_edges_and_gaps() -> None:
    assert choose_lr({0.1: Spread(5.0, None, 1), 0.2: Spread(5.0, None, 1), 0.3: None}) == 0.1
    results = dict([
        _result("a", 0.001, 0, 30.0, test=1.0), _result("a", 0.01, 0, 20.0, test=99.0),
        _result("a", 0.01, 1, 22.0, test=97.0), _result("a", 0.1, 0, math.inf),
        _result("b", 0.001, 0, 25.0, test=90.0), _result("b", 0.001, 1, 27.0, test=94.0),
    ])
    a, b = summarize(["a", "b"], {"a": [0.001, 0.01, 0.1], "b": [0.001, 0.01]}, results, reference="a",
                     grid_seeds=[0])
    # a's test perplexity at 0.001 is the lowest, but the choice is on validation
    assert a.chosen_lr == 0.01 and not a.at_edge and a.complete and a.diverged[0.1] == 1
    assert (a.val.mean, a.test.mean, a.test.n) == (21.0, 98.0, 2)
    assert b.chosen_lr == 0.001 and b.at_edge and not b.complete  # lr 0.01 has not run yet
    assert b.vs_reference is not None and b.vs_reference.mean == pytest.approx(-6.0)  # (90 - 99 + 94 - 97) / 2
    assert b.val_vs_reference.mean == pytest.approx(5.0)  # (25 - 20 + 27 - 22) / 2
    assert b.val_by_seed == {0: 25.0, 1: 27.0} and a.vs_reference is None and a.val_vs_reference is None
    # The seeds added at the chosen lr do not move the choice (only the grid's seeds count).
    flip = dict([_result("c", 0.001, 0, 30.0, test=1.0), _result("c", 0.003, 0, 30.1, test=1.0),
                 _result("c", 0.001, 1, 30.5, test=1.0), _result("c", 0.001, 2, 30.6, test=1.0)])
    (c,) = summarize(["c"], {"c": [0.001, 0.003]}, flip, reference="c", grid_seeds=[0])
    assert c.chosen_lr == 0.001 and c.test.n == 3 and c.grid[0.001].n == 1


def test_a_grid_with_some_seeds_missing_at_an_lr_is_not_complete() -> None:
    """With every seed in the grid (``all_seeds``), an lr that has run at one of them only is a
    mean over fewer seeds than the others: the choice is provisional and the report must say so."""
    results = dict([_result("a", 0.001, 0, 30.0), _result("a", 0.001, 1, 31.0),
                    _result("a", 0.01, 0, 20.0)])  # lr 0.01: seed 1 has not finished
    (a,) = summarize(["a"], {"a": [0.001, 0.01]}, results, reference="a", grid_seeds=[0, 1])
    assert a.chosen_lr == 0.01 and a.grid[0.01].n == 1 and not a.complete
    results.update([_result("a", 0.01, 1, 45.0)])  # mean 32.5 against 30.5
    (a,) = summarize(["a"], {"a": [0.001, 0.01]}, results, reference="a", grid_seeds=[0, 1])
    assert a.chosen_lr == 0.001 and a.complete


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> list:
    """Runs train in this process (fast); records the configs trained."""
    trained: list = []

    def direct(fn, config, resume):
        trained.append((config.optim.method, config.optim.lr, config.train.seed, resume))
        return fn(config, resume)

    monkeypatch.setattr(isolated, "run_isolated", direct)
    return trained


def test_sweep_leaves_another_commands_report_alone(tmp_path: Path, in_process: list) -> None:
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "report.md").write_text("# Pre-training comparison: recipe `micro`\n")
    with pytest.raises(FileExistsError, match="`fira-train sweep` did not write.*choose another --out$"):
        sweep(micro_config(tmp_path), ["adamw"], {"adamw": [0.001]}, [0], out)
    assert in_process == [] and (out / "report.md").read_text().startswith("# Pre-training comparison")


def test_a_sweep_without_reuse_leaves_another_sweeps_record_alone(tmp_path: Path, in_process: list) -> None:
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0")
    out = tmp_path / "sweep"
    sweep(config, ["adamw"], {"adamw": [0.001]}, [0], out)
    before = {name: (out / name).read_bytes() for name in ("sweep.json", "report.md")}
    in_process.clear()
    # other runs than its own: no run folder is in the way, but its sweep.json and report.md were
    with pytest.raises(FileExistsError, match=r"holds a sweep's sweep\.json.*--reuse.*another --out"):
        sweep(config, ["fira"], {"fira": [0.003]}, [0], out)
    assert in_process == [] and {name: (out / name).read_bytes() for name in before} == before
    assert not (out / "fira").exists()


def test_micro_sweep_end_to_end_and_reuse(tmp_path: Path, in_process: list) -> None:
    config = micro_config(tmp_path, "train.steps=4", "train.save_every=2", "train.eval_every=0",
                          "data.test_fraction=0.1")
    out = tmp_path / "sweep"
    report, rows = sweep(config, ["adamw", "fira"], {"adamw": [0.001, 0.01], "fira": [0.003, 0.01]}, [0, 1],
                         out, command="fira-train sweep ...")
    # Phase 1: every lr at seed 0; phase 2: seed 1 at each chosen lr only.
    assert len(in_process) == 6 and all(resume is None for *_, resume in in_process)
    saved = json.loads((out / "sweep.json").read_text())
    runs = {(r["spec"], r["lr"], r["seed"]): r for r in saved["runs"]}
    for row in rows:
        grid_val = {lr: runs[(row.spec, lr, 0)]["val_ppl"] for lr in (0.001, 0.01, 0.003) if (row.spec, lr, 0) in runs}
        assert row.chosen_lr == min(grid_val, key=grid_val.get)
        assert {s for (spec, lr, s) in runs if spec == row.spec and lr == row.chosen_lr} == {0, 1}
        summary = json.loads((RunKey(row.spec, row.chosen_lr, 1).folder(out) / "summary.json").read_text())
        assert row.test_by_seed[1] == summary["test_ppl"] and summary["test_tokens"] > 0
    adamw = next(r for r in rows if r.spec == "adamw")
    assert adamw.vs_reference is not None and adamw.vs_reference.n == 2 and adamw.vs_reference.low is not None
    text = report.read_text()
    assert "| adamw |" in text and "(reference)" in text and "fira-train sweep ..." in text
    assert "## Each seed at the chosen lr" in text and "| seed 0 | seed 1 |" in text
    assert (out / "lr.png").stat().st_size > 0

    # --report-only: the same files from sweep.json alone (no run folder is read, nothing trains)
    before = {name: (out / name).read_text() for name in ("report.md", "sweep.json")}
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(out / "sweep.json", alone / "sweep.json")
    in_process.clear()
    rebuilt, _ = rewrite_report(alone)
    assert in_process == [] and rebuilt.read_text() == before["report.md"]
    assert (alone / "sweep.json").read_text() == before["sweep.json"] and (alone / "lr.png").stat().st_size > 0

    # Again with --reuse: nothing trains, the same conclusions.
    in_process.clear()
    _, again = sweep(config, ["adamw", "fira"], {"adamw": [0.001, 0.01], "fira": [0.003, 0.01]}, [0, 1],
                     out, reuse=True)
    assert in_process == [] and [r.chosen_lr for r in again] == [r.chosen_lr for r in rows]
    # Without it, the existing runs are an error that says what to do.
    with pytest.raises(FileExistsError, match="--reuse"):
        sweep(config, ["adamw", "fira"], {"adamw": [0.001, 0.01], "fira": [0.003, 0.01]}, [0, 1], out)


def test_reuse_continues_an_unfinished_run_from_its_checkpoint(tmp_path: Path, in_process: list) -> None:
    config = micro_config(tmp_path, "train.steps=4", "train.save_every=2", "train.eval_every=0")
    out = tmp_path / "sweep"
    sweep(config, ["adamw"], {"adamw": [0.01]}, [0], out)
    folder = RunKey("adamw", 0.01, 0).folder(out)
    finished = json.loads((folder / "summary.json").read_text())
    # As if killed after the step-2 checkpoint: no summary, no step-4 checkpoint.
    (folder / "summary.json").unlink()
    assert [step for step, _ in ckpt.complete_checkpoints(folder)] == [2, 4]
    shutil.rmtree(ckpt.find_checkpoint(folder, 4))
    in_process.clear()
    _, (row,) = sweep(config, ["adamw"], {"adamw": [0.01]}, [0], out, reuse=True)
    assert in_process == [("adamw", 0.01, 0, "latest")]
    assert json.loads((folder / "summary.json").read_text())["val_loss"] == finished["val_loss"]
    assert [r["step"] for r in read_metrics(folder)] == [1, 2, 3, 4]
    assert row.val is not None and row.val.mean == pytest.approx(finished["val_ppl"])


def test_reuse_refuses_runs_of_another_config_before_any_starts(tmp_path: Path, in_process: list) -> None:
    """Runs made with another config are refused in this process, all in one error naming each
    and the settings changed, before any run starts (each was refused by its own process, after
    it had started, one after another)."""
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0")
    out = tmp_path / "sweep"
    sweep(config, ["adamw", "fira"], {"adamw": [0.001, 0.01], "fira": [0.01]}, [0], out)
    in_process.clear()
    longer = micro_config(tmp_path, "train.steps=3", "train.eval_every=0")
    with pytest.raises(ValueError, match=r"--reuse: 3 runs in .* cannot be continued with this sweep's config, so "
                                         r"no run was started: adamw/lr=0.001/seed=0, adamw/lr=0.01/seed=0 and "
                                         r"fira/lr=0.01/seed=0 have train.steps=2 \(now 3\)"):
        sweep(longer, ["adamw", "fira"], {"adamw": [0.001, 0.01], "fira": [0.01]}, [0], out, reuse=True)
    assert in_process == []
    # what a resume may change (the checkpoints' cadence) is no refusal: the runs are reused
    sweep(micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=1"), ["adamw", "fira"],
          {"adamw": [0.001, 0.01], "fira": [0.01]}, [0], out, reuse=True)
    assert in_process == []


def test_reuse_refuses_a_memory_lever_changed_on_finished_runs_before_any_starts(tmp_path: Path,
                                                                                in_process: list) -> None:
    """A memory lever may change on a resume, but not from the run's last step (nothing would train
    with it). Finished runs are then refused all at once before any starts, where each run's own
    process refused it after the others had trained; a run stopped earlier goes on with it."""
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=1")
    out = tmp_path / "sweep"
    sweep(config, ["galore", "fira"], {"galore": [0.01], "fira": [0.01]}, [0], out)
    in_process.clear()
    in_backward = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=1",
                               "optim.step_in_backward=true")
    with pytest.raises(ValueError, match=r"--reuse: 2 runs in .* so no run was started: galore/lr=0.01/seed=0 and "
                                         r"fira/lr=0.01/seed=0 have a checkpoint its resume refuses \(cannot resume from "
                                         r"step_00000002 with optim.step_in_backward=False \(now True\): it is the "
                                         r"run's last step \(train.steps=2\)"):
        sweep(in_backward, ["galore", "fira"], {"galore": [0.01], "fira": [0.01]}, [0], out, reuse=True)
    assert in_process == []
    # stopped after step 1 (as if killed): it continues from there with the lever
    folder = RunKey("fira", 0.01, 0).folder(out)
    (folder / "summary.json").unlink()
    shutil.rmtree(ckpt.find_checkpoint(folder, 2))
    sweep(in_backward, ["fira"], {"fira": [0.01]}, [0], out, reuse=True)
    assert in_process == [("fira", 0.01, 0, "latest")]


def test_reuse_takes_runs_whose_changed_settings_their_method_does_not_read(tmp_path: Path,
                                                                            in_process: list) -> None:
    """optim.gamma is the norm-growth limiter's: neither AdamW nor GaLore (no residual) reads it, so
    their runs made with another value are the runs asked for (as ``galore`` and
    ``galore@optim.gamma=1.05`` are one run), and are reused; Fira's, which reads it, are not."""
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "optim.gamma=1.01")
    out = tmp_path / "sweep"
    sweep(config, ["adamw", "galore", "fira"], {"adamw": [0.01], "galore": [0.01], "fira": [0.01]}, [0], out)
    in_process.clear()
    other = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "optim.gamma=1.05")
    sweep(other, ["adamw", "galore"], {"adamw": [0.01], "galore": [0.01]}, [0], out, reuse=True)
    assert in_process == []
    with pytest.raises(ValueError, match=r"fira/lr=0.01/seed=0 has optim.gamma=1.01 \(now 1.05\)"):
        sweep(other, ["fira"], {"fira": [0.01]}, [0], out, reuse=True)


def test_reuse_takes_a_run_recorded_before_state_rounding_as_rounded_to_nearest(tmp_path: Path,
                                                                                in_process: list) -> None:
    """A config.json without optim.state_rounding (written before the option) is the default run, and
    is reused; the spec of stochastic bf16 states is a run of its own."""
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0")
    out = tmp_path / "sweep"
    stochastic = "fira@optim.state_dtype=bfloat16@optim.state_rounding=stochastic"
    sweep(config, ["fira", stochastic], {"fira": [0.01], stochastic: [0.01]}, [0], out)
    folders = {spec: RunKey(spec, 0.01, 0).folder(out) for spec in ("fira", stochastic)}
    recorded = {spec: json.loads((folder / "config.json").read_text()) for spec, folder in folders.items()}
    assert recorded[stochastic]["optim"]["state_rounding"] == "stochastic"
    assert recorded["fira"]["optim"].pop("state_rounding") == "nearest"
    (folders["fira"] / "config.json").write_text(json.dumps(recorded["fira"]))
    in_process.clear()
    sweep(config, ["fira", stochastic], {"fira": [0.01], stochastic: [0.01]}, [0], out, reuse=True)
    assert in_process == []


def test_reuse_refuses_a_finished_run_trained_on_other_data(tmp_path: Path, in_process: list) -> None:
    """A finished run of the same config whose corpus has changed since is not reused beside runs
    on today's data (a sweep had paired new runs with runs on an earlier tokenizer)."""
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0")
    out = tmp_path / "sweep"
    sweep(config, ["adamw"], {"adamw": [0.01]}, [0], out)
    summary_path = RunKey("adamw", 0.01, 0).folder(out) / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["data"]["token_digest"] = "f" * 32
    summary_path.write_text(json.dumps(summary))
    in_process.clear()
    with pytest.raises(ValueError, match="holds a run of this config trained on other data"):
        sweep(config, ["adamw"], {"adamw": [0.01]}, [0], out, reuse=True)
    assert in_process == []


def test_reuse_refuses_a_finished_run_of_another_device_kind_under_device_auto(tmp_path: Path, in_process: list,
                                                                               monkeypatch) -> None:
    """train.device=auto is recorded as "auto" whether a run trained on a GPU (bf16 autocast
    under precision=auto) or here (fp32): the summary's device tells them apart."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "auto" is the CPU here, on any machine
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0")
    assert config.train.device == "auto"
    out = tmp_path / "sweep"
    sweep(config, ["adamw"], {"adamw": [0.01]}, [0], out)
    summary_path = RunKey("adamw", 0.01, 0).folder(out) / "summary.json"
    summary = json.loads(summary_path.read_text())
    assert summary["device"] == "cpu"
    sweep(config, ["adamw"], {"adamw": [0.01]}, [0], out, reuse=True)  # the same kind: reused
    assert summary["code"] == code_version()
    assert f"every run (1) was made by source `{code_version()['source']}`" in (out / "report.md").read_text()
    summary_path.write_text(json.dumps({**summary, "device": "cuda:0"}))
    in_process.clear()
    with pytest.raises(ValueError, match=r"trained on 'cuda:0', and train.device='auto' trains on 'cpu' here"):
        sweep(config, ["adamw"], {"adamw": [0.01]}, [0], out, reuse=True)
    assert in_process == []


def test_a_diverged_run_is_an_outcome_kept_on_reuse(tmp_path: Path, in_process: list) -> None:
    config = micro_config(tmp_path, "train.steps=3", "train.eval_every=0", "train.warmup_fraction=0")
    out = tmp_path / "sweep"
    # AdamW at lr 10 from the first step: the loss reaches the thousands at step 2 (a far larger lr
    # can saturate every norm instead and leave the loss at ln V on some CPUs): recorded as
    # diverged, not raised.
    _, (row,) = sweep(config, ["adamw"], {"adamw": [0.001, 10.0]}, [0], out)
    assert row.diverged[10.0] == 1 and row.chosen_lr == 0.001
    assert (RunKey("adamw", 10.0, 0).folder(out) / grid.DIVERGED_FILE).exists()
    in_process.clear()
    _, (again,) = sweep(config, ["adamw"], {"adamw": [0.001, 10.0]}, [0], out, reuse=True)
    assert in_process == [] and again.diverged[10.0] == 1
    assert "diverged" in (out / "report.md").read_text()
    # the divergence is an outcome on the data it was trained on: on other data, refused as a finished run is
    marker_path = RunKey("adamw", 10.0, 0).folder(out) / grid.DIVERGED_FILE
    marker = json.loads(marker_path.read_text())
    assert marker["data"]["corpus"] and marker["data"]["token_digest"]
    marker_path.write_text(json.dumps({**marker, "data": {**marker["data"], "token_digest": "f" * 32}}))
    with pytest.raises(ValueError, match="holds a run of this config trained on other data"):
        sweep(config, ["adamw"], {"adamw": [0.001, 10.0]}, [0], out, reuse=True)


def test_a_diverged_marker_records_its_device_and_code_and_is_checked_as_a_finished_run(
        tmp_path: Path, in_process: list, monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "auto" is the CPU here
    config = micro_config(tmp_path, "train.steps=3", "train.eval_every=0", "train.warmup_fraction=0")
    out = tmp_path / "sweep"
    sweep(config, ["adamw"], {"adamw": [10.0]}, [0], out)
    marker_path = RunKey("adamw", 10.0, 0).folder(out) / grid.DIVERGED_FILE
    marker = json.loads(marker_path.read_text())
    assert marker["device"] == "cpu" and marker["code"] == code_version()
    assert json.loads((out / "sweep.json").read_text())["runs"][0]["code"] == code_version()["source"]
    # made by other code: reused (its config and data match), with a warning naming both
    marker_path.write_text(json.dumps({**marker, "code": {**marker["code"], "source": "0" * 16}}))
    in_process.clear()
    with caplog.at_level("WARNING", logger="fira_train.run.run_dir"):
        _, (row,) = sweep(config, ["adamw"], {"adamw": [10.0]}, [0], out, reuse=True)
    assert in_process == [] and row.diverged[10.0] == 1
    assert describe_change({**marker["code"], "source": "0" * 16}) in caplog.text
    assert f"source {'0' * 16}" in caplog.text and f"this code's source {code_version()['source']}" in caplog.text
    assert "2 versions of the code" not in (out / "report.md").read_text()  # one run, one version
    assert f"every run (1) was made by source `{'0' * 16}`" in (out / "report.md").read_text()
    # trained on a GPU: not reused where train.device=auto is the CPU
    marker_path.write_text(json.dumps({**marker, "device": "cuda:0"}))
    with pytest.raises(ValueError, match=r"trained on 'cuda:0', and train.device='auto' trains on 'cpu' here"):
        sweep(config, ["adamw"], {"adamw": [10.0]}, [0], out, reuse=True)
    assert in_process == []


def test_sweep_refuses_torchrun_parallelism_and_bad_jobs(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "train.parallel=ddp")
    with pytest.raises(ValueError, match="train.parallel='ddp' is not supported"):
        sweep(config, ["adamw"], {"adamw": [0.01]}, [0], tmp_path / "out")
    with pytest.raises(ValueError, match="--jobs must be >= 1, got 0"):
        sweep(micro_config(tmp_path), ["adamw"], {"adamw": [0.01]}, [0], tmp_path / "out", jobs=0)
    with pytest.raises(ValueError, match="optim.state_dtype='int8' needs a Fira-family method"):
        sweep(micro_config(tmp_path, "optim.state_dtype=int8"), ["fira", "adamw"],
              {"fira": [0.01], "adamw": [0.001]}, [0], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before the first run


def test_sweep_under_torchrun_is_refused_before_anything_starts(tmp_path: Path, monkeypatch) -> None:
    """`torchrun --nproc_per_node 2 -m fira_train sweep ...`: each process started the sweep into
    the same --out and each run's process stopped with "2 processes were launched (torchrun) but
    train.parallel is 'none': pass --parallel ddp ...", which sweep then refuses; the empty --out
    stayed. The refusal is the sweep's, said once (rank 0) for every process alike."""
    from fira_train.run.launch import SAME_ON_EVERY_RANK

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    refusal = (r"sweep runs each training in its own process \(--jobs\): launch it in one process, not under "
               r"torchrun \(2 processes were launched\)")
    with pytest.raises(ValueError, match=refusal) as caught:
        sweep(micro_config(tmp_path), ["adamw"], {"adamw": [0.01]}, [0], tmp_path / "out")
    assert getattr(caught.value, SAME_ON_EVERY_RANK, False)
    monkeypatch.delenv("WORLD_SIZE")  # and with --parallel in one process: refused alike
    with pytest.raises(ValueError, match="train.parallel='ddp' is not supported") as caught:
        sweep(micro_config(tmp_path, "train.parallel=ddp"), ["adamw"], {"adamw": [0.01]}, [0], tmp_path / "out")
    assert getattr(caught.value, SAME_ON_EVERY_RANK, False)
    assert not (tmp_path / "out").exists()


def test_two_lrs_that_name_one_run_folder_are_refused_before_anything_trains(tmp_path: Path,
                                                                               in_process: list) -> None:
    """Run folders name the lr to 6 significant digits: 0.01 and 0.0100000001 shared
    lr=0.01/seed=0, and the second run stopped the sweep (naming --resume, not a sweep flag)
    after the first had trained."""
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"--lrs adamw: 0\.01 and 0\.0100000001 would share the run folder lr=0\.01"):
        sweep(micro_config(tmp_path, "train.steps=2"), ["adamw"], {"adamw": [0.01, 0.0100000001]}, [0], out)
    assert in_process == [] and not out.exists()
    sweep(micro_config(tmp_path, "train.steps=2"), ["adamw"], {"adamw": [0.01, 0.010001]}, [0], out)  # lr=0.010001
    assert sorted(p.name for p in (out / "adamw").iterdir()) == ["lr=0.01", "lr=0.010001"]


@pytest.mark.parametrize("saved", [[], {"version": 999},
                                   {"recipe": "micro", "methods": [1], "lrs": {}, "seeds": [0], "all_seeds": False,
                                    "reference": "a", "runs": []},
                                   {"recipe": "micro", "methods": [], "lrs": {"a": ["abc"]}, "seeds": [0],
                                    "all_seeds": False, "reference": "a", "runs": []},
                                   {"recipe": "micro", "methods": [], "lrs": {}, "seeds": [0], "all_seeds": False,
                                    "reference": "a", "runs": "x"}])
def test_report_only_names_a_sweep_json_of_another_shape(tmp_path: Path, saved) -> None:
    """Valid JSON that is not a sweep's record was a traceback (KeyError 'runs', TypeError ...)."""
    from fira_train.files import DamagedFileError

    (tmp_path / "sweep.json").write_text(json.dumps(saved))
    with pytest.raises(DamagedFileError, match=r"sweep.json is damaged \(not a sweep's record: .*--reuse"):
        rewrite_report(tmp_path)
    assert not (tmp_path / "report.md").exists()


def test_report_only_leaves_a_report_another_command_wrote(tmp_path: Path) -> None:
    """--report-only replaced OUT/report.md whatever wrote it (a compare's, the user's own), where
    a sweep refuses such a folder: the report was lost."""
    saved = {"recipe": "micro", "methods": [{"spec": "fira"}], "lrs": {"fira": [0.01]}, "seeds": [0],
             "all_seeds": False, "reference": "fira",
             "runs": [{"spec": "fira", "lr": 0.01, "seed": 0, "val_ppl": 110.0, "test_ppl": 105.0, "test_set": True,
                       "diverged": False, "code": None}]}
    (tmp_path / "sweep.json").write_text(json.dumps(saved))
    (tmp_path / "report.md").write_text("# My notes on this sweep\n")
    with pytest.raises(FileExistsError, match="holds a report.md that `fira-train sweep` did not write"):
        rewrite_report(tmp_path)
    assert (tmp_path / "report.md").read_text() == "# My notes on this sweep\n"
    assert not (tmp_path / "lr.png").exists()
    (tmp_path / "report.md").unlink()  # its own report is written again
    rebuilt, _ = rewrite_report(tmp_path)
    assert rebuilt.read_text().startswith("# Learning-rate sweep")


@pytest.mark.parametrize("out", ["corpus", "corpus/sweep"])
def test_an_out_that_is_or_lies_in_the_corpus_folder_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                             out: str) -> None:
    """sweep.json, written beside the runs' folders after the first run, was read as a document
    by the next run's process (each lists the corpus leaving out its own folder alone): 'invalid
    JSON' there, or at the next sweep --reuse."""
    config = micro_config(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "corpus").rglob("*"))
    with pytest.raises(ValueError, match=r"\(--out\) (is|lies inside) the corpus folder .*sweep\.json would be read"):
        sweep(config, ["adamw"], {"adamw": [0.001, 0.01]}, [0], tmp_path / out)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "corpus").rglob("*")) == before
