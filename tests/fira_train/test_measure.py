"""``fira-train memory --measure``: each spec measured in its own process, beside its estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fira_train.cli import main


def test_measure_writes_a_row_per_spec(tmp_path: Path, capsys, monkeypatch) -> None:
    # glibc's allocator settings change a resident-set peak: the record keeps them
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    corpus = tmp_path / "corpus"
    from tests.fira_train.harness_fixtures import write_corpus

    write_corpus(corpus)
    out = tmp_path / "mem"
    specs = "adamw,fira@optim.state_dtype=bfloat16"
    code = main(["memory", "--measure", "--recipe", "micro", "--methods", specs, "--steps", "2",
                 "--out", str(out), f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.vocab_size=300", "train.num_threads=1"])
    assert code == 0
    record = json.loads((out / "memory.json").read_text())
    assert [row["method"] for row in record["rows"]] == specs.split(",")
    for row in record["rows"]:
        assert row["measured_peak_bytes"] > 0 and row["estimated_bytes"] > 0
        assert len(row["measured"]["losses"]) == 2
    adamw, fira = record["rows"]
    assert fira["measured"]["optimizer_state_bytes"] < adamw["measured"]["optimizer_state_bytes"]
    assert "| fira@optim.state_dtype=bfloat16 |" in (out / "memory.md").read_text()
    assert record["malloc_env"] == {"MALLOC_ARENA_MAX": "2"}
    assert "MALLOC_ARENA_MAX=2 fira-train memory --measure" in (out / "memory.md").read_text()


@pytest.mark.parametrize(("argv", "message"), [
    (["memory", "--measure", "--recipe", "micro"], "needs --recipe NAME and --methods"),
    (["memory", "--recipe", "micro", "train.batch_size=2"], "go with --measure"),
    (["memory", "--measure", "--recipe", "micro", "--methods", "fira@rank"], "not a key=value"),
    (["memory", "--steps", "-4"], "go with --measure"),  # the estimate takes neither --steps nor --out
    (["memory", "--out", "x"], "go with --measure"),
    (["memory", "--measure", "--recipe", "micro", "--methods", "fira", "--steps", "1", "train.steps=50"],
     "drop the override 'train.steps=50'"),
    (["memory", "--measure", "--recipe", "micro", "--methods", "adamw", "train.parallel=ddp"],
     "train.parallel: memory --measure measures each method in one process"),  # was a traceback
    (["memory", "--measure", "--recipe", "micro", "--methods", "fira,adamw", "optim.state_dtype=int8"],
     "optim.state_dtype='int8' needs a Fira-family method"),  # before fira's run, not after it
])
def test_measure_refuses_bad_requests_in_one_line(argv, message, capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 1
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written


def test_the_estimate_table_covers_the_paper_sizes_and_says_what_fits() -> None:
    from fira_train.measure import ESTIMATE_PARTS, ESTIMATE_SPECS, estimate_rows, format_estimate_rows

    rows = estimate_rows()
    assert {(r["size"], r["method"]) for r in rows} == {
        (size, spec) for size in ("60m", "130m", "350m", "1b", "7b") for spec in ESTIMATE_SPECS}
    for r in rows:  # on a GPU the activations are freed before a step outside the backward pass
        overlap = 0 if "step_in_backward" in r["method"] else min(r["activations"], r["step_temporaries"])
        assert r["total"] == sum(r[k] for k in ESTIMATE_PARTS) - overlap
        assert r["fits_24gb"] == (r["total"] < 24 * 10**9)
    by = {(r["size"], r["method"]): r for r in rows}
    assert not by["7b", "adamw"]["fits_24gb"]
    for size in ("60m", "1b", "7b"):  # every option lowers the estimate, in the order of the table
        totals = [by[size, spec]["total"] for spec in ESTIMATE_SPECS[2:]]
        assert totals == sorted(totals, reverse=True)
    assert "| 7b | adamw |" in format_estimate_rows(rows)


def test_the_estimate_takes_a_specs_own_settings_without_measuring(capsys) -> None:
    """``memory --methods SPEC`` was refused ('go with --measure'): a custom spec had no estimate
    short of training it. --methods and --recipe now choose the run estimate's rows."""
    spec = "fira@optim.state_dtype=int8@optim.step_in_backward=true"
    assert main(["memory", "--methods", spec, "--recipe", "60m"]) == 0
    out = capsys.readouterr().out
    assert f"| 60m | {spec} |" in out and "one 256-token sequence per step" in out
    assert "Paper (G)" not in out and "| 1b |" not in out  # the chosen rows only
    assert main(["memory", "--methods", "fira"]) == 0  # every size without --recipe
    out = capsys.readouterr().out
    assert all(f"| {size} | fira |" in out for size in ("60m", "130m", "350m", "1b", "7b"))


def test_the_estimate_refuses_a_spec_it_does_not_model_by_name(capsys) -> None:
    assert main(["memory", "--methods", "fira,lora@optim.rank=8"]) == 1
    err = capsys.readouterr().err
    assert "'lora@optim.rank=8'" in err and "not estimated: lora, relora" in err and "Traceback" not in err


def test_the_estimate_warns_of_a_spec_whose_rank_projects_nothing() -> None:
    """Measured, the optimizer warns that a rank above every matrix projects none; estimated, the
    row was AdamW's without a word."""
    from fira_train.measure import estimate_rows

    with pytest.warns(UserWarning, match=r"--methods 'fira@optim.rank=4096' at 60m: optim.rank=4096 .* none is"):
        estimate_rows(("60m",), ("fira@optim.rank=4096",))


def test_the_estimate_warns_of_a_spec_setting_its_method_does_not_read(capsys, caplog) -> None:
    assert main(["memory", "--recipe", "60m", "--methods", "adamw@optim.rank=4"]) == 0
    # with the prefix of the command's other warnings (the line was bare)
    assert ("fira-train memory: warning: optim.rank is not used by adamw: it has no effect on the run "
            "adamw@optim.rank=4") in caplog.text


def test_a_specs_micro_batch_alone_is_the_estimates_batch(capsys) -> None:
    """The estimate's batch of one is its own: @train.micro_batch_size=4 was refused as no divisor
    of train.batch_size=1, which the user never gave."""
    assert main(["memory", "--recipe", "tiny", "--methods", "fira,fira@train.micro_batch_size=4"]) == 0
    assert "| tiny | fira@train.micro_batch_size=4 | 4 sequences of 256 tokens |" in capsys.readouterr().out
    assert main(["memory", "--recipe", "tiny", "--methods", "fira@train.micro_batch_size=-4"]) == 1
    assert "train.micro_batch_size" in capsys.readouterr().err  # a bad value is still the spec's own error


def test_an_estimate_of_rows_under_a_gb_is_in_mb() -> None:
    """micro's row read 0.00 in every column."""
    from fira_train.measure import estimate_rows, format_estimate_rows

    rows = estimate_rows(("micro",), ("adamw",))
    text = format_estimate_rows(rows)
    assert "in MB (10^6 bytes)" in text and f"| {rows[0]['total'] / 1e6:.2f} | yes |" in text
    assert "| 0.00 | 0.00 |" not in text
    assert "in GB (10^9 bytes)" in format_estimate_rows(estimate_rows(("micro", "60m"), ("adamw",)))


def test_the_estimate_says_a_specs_own_micro_batch_in_its_row() -> None:
    from fira_train.measure import estimate_rows, format_estimate_rows

    text = format_estimate_rows(estimate_rows(("tiny",), ("fira", "fira@train.batch_size=4@train.micro_batch_size=4")))
    assert "one 256-token sequence per step" not in text and "| Micro-batch |" in text
    assert "| tiny | fira | one 256-token sequence |" in text
    assert "| tiny | fira@train.batch_size=4@train.micro_batch_size=4 | 4 sequences of 256 tokens |" in text


def test_a_spec_on_the_cpu_is_estimated_on_the_cpu() -> None:
    """A spec's @train.device=cpu was estimated as on a GPU (AdamW's multi-tensor step, the
    activations freed before the step) under a title saying "on a GPU"."""
    from fira_train.measure import ESTIMATE_PARTS, estimate_rows, format_estimate_rows

    rows = estimate_rows(("micro",), ("adamw@train.device=cpu",))
    assert rows[0]["device"] == "cpu" and rows[0]["total"] == sum(rows[0][k] for k in ESTIMATE_PARTS)
    text = format_estimate_rows(rows)
    assert "on the CPU" in text and "on a GPU" not in text and "multi-tensor" not in text
    both = format_estimate_rows(estimate_rows(("micro",), ("adamw@train.device=cpu", "adamw")))
    assert "on the device of its row" in both and "| Device |" in both
    assert "| micro | adamw@train.device=cpu | CPU |" in both and "| micro | adamw | GPU |" in both
    assert "on a GPU (" in format_estimate_rows(estimate_rows(("micro",), ("adamw",)))


def test_a_stopped_measurement_keeps_the_methods_it_measured(tmp_path: Path, monkeypatch) -> None:
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    calls = []

    def fake(fn, config, steps):
        calls.append(config.optim.method)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user stops the second method
        return {"measured_peak_bytes": 1000, "baseline_bytes": 0, "measure": "fake", "device": "cpu",
                "vocab_size": 300, "parameters": 10, "weights_bytes": 40, "optimizer_state_bytes": 80,
                "losses": [1.0]}

    monkeypatch.setattr(measure, "run_isolated", fake)
    with pytest.raises(KeyboardInterrupt):
        measure.measure(micro_config(tmp_path), parse_method_specs("adamw,fira"), 1, tmp_path / "m")
    record = json.loads((tmp_path / "m" / "memory.json").read_text())
    assert [r["method"] for r in record["rows"]] == ["adamw"] and record["complete"] is False
    assert "incomplete" in (tmp_path / "m" / "memory.md").read_text()


def _fake_runs(peaks: dict[str, int], stop_at: str | None = None):
    """A ``run_isolated`` stand-in: each method's measured peak from ``peaks``; ``stop_at``: the
    method during which the user stops the command."""

    def fake(fn, config, steps):
        if config.optim.method == stop_at:
            raise KeyboardInterrupt
        return {"measured_peak_bytes": peaks[config.optim.method], "baseline_bytes": 0, "measure": "fake",
                "device": "cpu", "vocab_size": 300, "parameters": 10, "weights_bytes": 40,
                "optimizer_state_bytes": 80, "losses": [1.0]}

    return fake


def test_append_keeps_earlier_rows_replaces_remeasured_ones_and_lists_every_command(tmp_path: Path, monkeypatch):
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    config, out = micro_config(tmp_path), tmp_path / "m"
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 1000, "galore": 2000, "fira": 3000}))
    measure.measure(config, parse_method_specs("adamw,galore"), 1, out, "first")
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"galore": 2500, "fira": 3000}, stop_at="fira"))
    with pytest.raises(KeyboardInterrupt):  # galore measured again, then stopped during fira
        measure.measure(config, parse_method_specs("galore,fira"), 1, out, "second", append=True)
    record = json.loads((out / "memory.json").read_text())
    assert [(r["method"], r["measured_peak_bytes"]) for r in record["rows"]] == [("adamw", 1000), ("galore", 2500)]
    assert record["command"] == "first\nsecond  # stopped after 1 of 2 methods" and record["complete"] is False
    assert "incomplete" in (out / "memory.md").read_text()
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({}, stop_at="fira"))
    with pytest.raises(KeyboardInterrupt):  # stopped during its first method: listed all the same
        measure.measure(config, parse_method_specs("fira"), 1, out, "third", append=True)
    assert json.loads((out / "memory.json").read_text())["command"].endswith("\nthird  # stopped after 0 of 1 methods")

    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"galore": 2500, "fira": 3000}))
    measure.measure(config, parse_method_specs("galore,fira"), 1, out, "second", append=True)  # the same, rerun
    measure.measure(config, parse_method_specs("fira"), 1, out, "third", append=True)
    record = json.loads((out / "memory.json").read_text())
    assert [r["method"] for r in record["rows"]] == ["adamw", "galore", "fira"]
    assert record["command"] == "first\nsecond\nthird" and record["complete"] is True
    text = (out / "memory.md").read_text()
    assert "incomplete" not in text and "first\nsecond\nthird\n```" in text

    with pytest.raises(FileExistsError, match="pass --append"):  # without --append the table stays whole
        measure.measure(config, parse_method_specs("fira"), 1, out, "fourth")
    assert [r["method"] for r in json.loads((out / "memory.json").read_text())["rows"]] == ["adamw", "galore", "fira"]


@pytest.mark.parametrize("text", ['{"loss": 1.5}', "not json"])
def test_an_out_holding_another_tools_memory_json_is_not_told_to_append(tmp_path: Path, text: str):
    """It said "already holds a measurement: pass --append", which --append then refused."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    (tmp_path / "memory.json").write_text(text)
    with pytest.raises(FileExistsError, match=r"holds a memory.json that memory --measure did not write") as caught:
        measure.measure(micro_config(tmp_path / "run"), parse_method_specs("fira"), 1, tmp_path, "first")
    assert "--append" not in str(caught.value)
    assert (tmp_path / "memory.json").read_text() == text


def test_append_keeps_an_earlier_tables_stop_and_its_rows_dates(tmp_path: Path, monkeypatch):
    """A table left incomplete without --append (or written by hand) stays incomplete: which of its
    commands stopped is not known. Its rows keep the day they were measured."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    config, out = micro_config(tmp_path), tmp_path / "m"
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 1000}, stop_at="fira"))
    with pytest.raises(KeyboardInterrupt):
        measure.measure(config, parse_method_specs("adamw,fira"), 1, out, "first")
    old = json.loads((out / "memory.json").read_text())
    old["date"] = "2026-01-02"
    for row in old["rows"]:
        del row["date"]  # as tables written before rows carried their day
    (out / "memory.json").write_text(json.dumps(old))
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"fira": 3000}))
    measure.measure(config, parse_method_specs("fira"), 1, out, "second", append=True)
    record = json.loads((out / "memory.json").read_text())
    assert [r["method"] for r in record["rows"]] == ["adamw", "fira"] and record["complete"] is False
    assert record["command"] == f"first\n{measure.EARLIER_STOP}\nsecond"
    assert record["rows"][0]["date"] == "2026-01-02" != record["rows"][1]["date"]
    assert f"2026-01-02 to {record['rows'][1]['date']}." in (out / "memory.md").read_text()


def test_a_table_is_complete_once_every_method_its_commands_name_has_a_row(tmp_path: Path, monkeypatch):
    """Where every command names its --methods, a stopped command's methods measured by a later
    command complete the table; until then the header names the methods not measured yet."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    config, out = micro_config(tmp_path), tmp_path / "m"

    def command(methods: str) -> str:
        return f"fira-train memory --measure --recipe micro --methods {methods} --out {out}"

    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 1000, "galore": 2000}, stop_at="fira"))
    with pytest.raises(KeyboardInterrupt):  # without --append: which command stopped is not marked
        measure.measure(config, parse_method_specs("adamw,fira"), 1, out, command("adamw,fira"))
    measure.measure(config, parse_method_specs("galore"), 1, out, command("galore"), append=True)
    record = json.loads((out / "memory.json").read_text())
    assert record["complete"] is False and record["missing"] == ["fira"]
    assert "(incomplete: not measured yet: fira)" in (out / "memory.md").read_text()
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"fira": 3000}))
    measure.measure(config, parse_method_specs("fira"), 1, out, command("fira").replace(" fira ", "=fira "),
                    append=True)
    record = json.loads((out / "memory.json").read_text())
    # every method measured: a line saying that a command stopped would read as a gap in the table
    assert record["command"] == "\n".join([command("adamw,fira"), command("galore"),
                                           command("fira").replace(" fira ", "=fira ")])
    assert record["complete"] is True and "missing" not in record
    assert "incomplete" not in (out / "memory.md").read_text() and "stopped" not in (out / "memory.md").read_text()


def test_a_stopped_appends_mark_goes_once_its_methods_are_measured(tmp_path: Path, monkeypatch):
    """The rerun the interruption hint gives (--append, the methods not measured yet) completes the
    table: the first command's '# stopped after' mark went on standing in memory.md."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    config, out = micro_config(tmp_path), tmp_path / "m"
    first = "fira-train memory --measure --methods adamw,fira --append"
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 1000}, stop_at="fira"))
    with pytest.raises(KeyboardInterrupt):
        measure.measure(config, parse_method_specs("adamw,fira"), 1, out, first, append=True)
    assert measure.PROGRESS_MARK in json.loads((out / "memory.json").read_text())["command"]
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"fira": 3000}))
    measure.measure(config, parse_method_specs("fira"), 1, out, "fira-train memory --measure --methods fira --append",
                    append=True)
    record = json.loads((out / "memory.json").read_text())
    assert record["complete"] is True
    assert record["command"] == f"{first}\nfira-train memory --measure --methods fira --append"
    assert "stopped" not in (out / "memory.md").read_text()


def test_append_refuses_a_table_of_another_setting_before_training(tmp_path: Path, monkeypatch):
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    config, out = micro_config(tmp_path), tmp_path / "m"
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 1000}))
    measure.measure(config, parse_method_specs("adamw"), 1, out, "first")
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({}, stop_at="adamw"))  # must not be reached
    with pytest.raises(ValueError, match=r"--append: .*memory.json was measured with number of steps 1, this "
                                         r"command with 2"):
        measure.measure(config, parse_method_specs("adamw"), 2, out, "second", append=True)
    with pytest.raises(ValueError, match=r"--append: .*memory.json was measured with other settings for every "
                                         r"method: optim.betas=\[0.9, 0.999\] \(now \[0.9, 0.95\]\), "
                                         r"train.micro_batch_size=4 \(now 2\)"):
        measure.measure(micro_config(tmp_path, "train.micro_batch_size=2", "optim.betas=0.9,0.95"),
                        parse_method_specs("adamw"), 1, out, "second", append=True)
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"fira": 900}))
    measure.measure(micro_config(tmp_path, "train.seed=3", "train.save_every=7"), parse_method_specs("fira"), 1, out,
                    "same settings but what does not change a peak", append=True)
    assert [row["method"] for row in json.loads((out / "memory.json").read_text())["rows"]] == ["adamw", "fira"]
    # train.device=auto names no device kind (each row records the one it ran on): cpu joins the table
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"galore": 950}))
    measure.measure(micro_config(tmp_path, "train.device=cpu"), parse_method_specs("galore"), 1, out,
                    "the device named", append=True)
    assert [row["method"] for row in json.loads((out / "memory.json").read_text())["rows"]] == ["adamw", "fira",
                                                                                                "galore"]
    for wrong in ("[]", '{"recipe": "micro"}'):  # JSON, but not a measurement: one line, not a KeyError
        (out / "memory.json").write_text(wrong)
        with pytest.raises(ValueError, match="is not a measurement written by memory --measure"):
            measure.measure(config, parse_method_specs("adamw"), 1, out, "third", append=True)


def test_append_takes_a_table_written_before_train_dist_timeout_s(tmp_path: Path, monkeypatch):
    """A table measured before train.dist_timeout_s existed has no such setting: --append refused it
    as another setting ("train.dist_timeout_s=None (now 0.0)"), though memory --measure runs each
    method in one process (no process group, so no collective's timeout) and the key changes no
    peak; a table measured with another value is the same setting too."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    config, out = micro_config(tmp_path), tmp_path / "m"
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 1000}))
    measure.measure(config, parse_method_specs("adamw"), 1, out, "first")
    record = json.loads((out / "memory.json").read_text())
    record["settings"].pop("train.dist_timeout_s", None)  # as the release before the key wrote it
    (out / "memory.json").write_text(json.dumps(record))
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"fira": 900}))
    measure.measure(config, parse_method_specs("fira"), 1, out, "second", append=True)
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"galore": 950}))
    measure.measure(micro_config(tmp_path, "train.dist_timeout_s=60"), parse_method_specs("galore"), 1, out,
                    "third", append=True)
    record = json.loads((out / "memory.json").read_text())
    assert [row["method"] for row in record["rows"]] == ["adamw", "fira", "galore"]
    record["settings"]["train.dist_timeout_s"] = 0.0  # as the release that added the key wrote it
    (out / "memory.json").write_text(json.dumps(record))
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"apollo": 920}))
    measure.measure(config, parse_method_specs("apollo"), 1, out, "fourth", append=True)


@pytest.mark.parametrize(("change", "said"), [
    (lambda record: record["rows"][0].update(date=5), "row 1: date is 5, not a string"),
    (lambda record: record["rows"][0].pop("measured"), "row 1: no measured"),
    (lambda record: record["rows"][0].update(method=["adamw"]), 'row 1: method is ["adamw"], not a string'),
    (lambda record: record["rows"][0]["measured"].update(parameters="10"),
     'row 1: measured.parameters is "10", not an integer'),
    (lambda record: record.update(rows=[1]), "row 1 is a JSON int, not an object"),
    (lambda record: record.update(command=5), "command is 5, not a string or null"),
    (lambda record: record.update(settings=[]), "settings is [], not an object"),
])
def test_append_refuses_a_record_of_another_shape_before_measuring(change, said: str, tmp_path: Path, monkeypatch,
                                                                    capsys) -> None:
    """Valid JSON holding other types (edited, another tool's) was a traceback, a row's date of
    another type only after the first method was measured: one line naming the file, first."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    config, out = micro_config(tmp_path), tmp_path / "m"
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 1000}))
    measure.measure(config, parse_method_specs("adamw"), 1, out, "first")
    record = json.loads((out / "memory.json").read_text())
    change(record)
    (out / "memory.json").write_text(json.dumps(record))
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({}, stop_at="fira"))  # must not be reached
    monkeypatch.setattr(measure, "build_corpus", lambda data: pytest.fail("tokenised before the check"))
    with pytest.raises(ValueError) as raised:
        measure.measure(config, parse_method_specs("fira"), 1, out, "second", append=True)
    assert str(raised.value) == (f"--append: {out / 'memory.json'} is not a measurement written by memory --measure "
                                 f"({said}); delete it, or measure into another --out")


def test_side_by_side_appends_lose_no_row(tmp_path: Path) -> None:
    """Two processes appending into one folder at once: every row of both ends up in the table.

    Each write is slowed down, so that without the lock one process would read the table while the
    other is between its read and its write, and one of them would drop the other's row."""
    import subprocess
    import sys

    from fira_train.data.build import build_corpus
    from tests.fira_train.harness_fixtures import micro_config

    build_corpus(micro_config(tmp_path).data)  # both lanes find the tokenised corpus in the cache
    out = tmp_path / "m"
    code = f"""
import sys, time
from pathlib import Path
from fira_train import measure
from fira_train.config.method_spec import parse_method_specs
from tests.fira_train.harness_fixtures import micro_config

def fake(fn, config, steps):
    return {{"measured_peak_bytes": 1, "baseline_bytes": 0, "measure": "fake", "device": "cpu", "vocab_size": 300,
            "parameters": 10, "weights_bytes": 4, "optimizer_state_bytes": 8, "losses": [1.0]}}

def slow_write(path, text, write=measure.write_text_atomic):
    time.sleep(0.25)
    return write(path, text)

measure.run_isolated, measure.write_text_atomic = fake, slow_write
measure.measure(micro_config(Path({str(tmp_path)!r})), parse_method_specs(sys.argv[1]), 1, {str(out)!r}, sys.argv[1],
                append=True)
"""
    lanes = ["adamw,galore,fira", "fira@optim.rank=2,galore@optim.rank=2,adamw@optim.lr=0.1"]
    root = Path(__file__).parents[2]  # the lanes import the test fixtures from the repository
    procs = [subprocess.Popen([sys.executable, "-c", code, specs], cwd=root) for specs in lanes]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    record = json.loads((out / "memory.json").read_text())
    assert sorted(r["method"] for r in record["rows"]) == sorted(",".join(lanes).split(","))
    assert sorted(record["command"].split("\n")) == sorted(lanes) and record["complete"] is True


def test_methods_the_estimate_does_not_model_show_no_estimate(tmp_path: Path, monkeypatch) -> None:
    """LoRA was estimated as full-weight AdamW, SGD and Adagrad with two moments."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from fira_train.config.overrides import apply_overrides
    from fira_train.memory.run_estimate import estimate_run_bytes
    from tests.fira_train.harness_fixtures import micro_config

    config = micro_config(tmp_path)
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"lora": 1000, "adamw": 2000}))
    md, _ = measure.measure(config, parse_method_specs("lora,adamw"), 1, tmp_path / "m", "cmd")
    rows = {r["method"]: r for r in json.loads((tmp_path / "m" / "memory.json").read_text())["rows"]}
    assert rows["lora"]["estimated_bytes"] is None and rows["adamw"]["estimated_bytes"] > 0
    assert "| lora | 0.0 MiB | - | - |" in md.read_text()

    def states(method: str) -> int:
        return estimate_run_bytes(apply_overrides(config, [f"optim.method={method}"]), 300)["optimizer_states"]

    assert states("sgd") == states("adagrad") == states("adamw") // 2  # one state per weight, not two


def test_the_heading_names_one_model_size_and_device_only_where_every_row_has_them(tmp_path: Path, monkeypatch):
    """A spec may change the model or the device: the heading gave the first row's parameters and
    device for the whole table; they are now a column where the rows differ."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    def fake(fn, config, steps):
        wide = config.model.hidden_size == 128
        return {"measured_peak_bytes": 1000, "baseline_bytes": 0, "measure": "fake",
                "device": "cuda" if wide else "cpu", "vocab_size": 300, "parameters": 400_000 if wide else 200_000,
                "weights_bytes": 40, "optimizer_state_bytes": 80, "losses": [1.0]}

    monkeypatch.setattr(measure, "run_isolated", fake)
    md, _ = measure.measure(micro_config(tmp_path), parse_method_specs("adamw,adamw@model.hidden_size=128"), 1,
                            tmp_path / "m", "cmd")
    text = md.read_text()
    assert "0.2M parameters" not in text and "device `cpu`;" not in text
    assert "parameters per row, device per row;" in text
    assert "| Method | Parameters | Device | Measured peak |" in text
    assert "| adamw | 0.2M | `cpu` | " in text and "| adamw@model.hidden_size=128 | 0.4M | `cuda` | " in text
    md, _ = measure.measure(micro_config(tmp_path), parse_method_specs("adamw"), 1, tmp_path / "one", "cmd")
    assert "0.2M parameters, device `cpu`;" in md.read_text() and "| Method | Measured peak |" in md.read_text()


def test_a_specs_own_thread_count_is_said_not_the_commands(tmp_path: Path, monkeypatch):
    """A spec's @train.num_threads=N ran with N threads while the heading gave the command's count
    for every row: one count differing from the command's is the heading's, several a column."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    def fake(fn, config, steps):
        return {"measured_peak_bytes": 1000, "baseline_bytes": 0, "measure": "fake", "device": "cpu",
                "vocab_size": 300, "parameters": 200_000, "weights_bytes": 40, "optimizer_state_bytes": 80,
                "losses": [1.0], "threads": config.train.num_threads or 7}

    monkeypatch.setattr(measure, "run_isolated", fake)
    config = micro_config(tmp_path, "train.num_threads=2")
    md, _ = measure.measure(config, parse_method_specs("adamw,fira@train.num_threads=1"), 1, tmp_path / "m", "cmd")
    text = md.read_text()
    assert "2 threads" not in text and ", threads per row, torch" in text
    assert "| Method | Threads | Measured peak |" in text
    assert "| adamw | 2 | " in text and "| fira@train.num_threads=1 | 1 | " in text
    md, _ = measure.measure(config, parse_method_specs("fira@train.num_threads=1"), 1, tmp_path / "one", "cmd")
    assert ", 1 thread, torch" in md.read_text() and "| Method | Measured peak |" in md.read_text()
    record = json.loads((tmp_path / "m" / "memory.json").read_text())
    for row in record["rows"]:
        del row["measured"]["threads"]  # as rows measured before each recorded its count
    text = measure.format_measurement(record)
    assert "| adamw | 2 | " in text and "| fira@train.num_threads=1 | 1 | " in text  # the spec's, else the command's


def test_append_takes_another_thread_count_not_another_machine(tmp_path: Path, monkeypatch):
    """--append with another command-wide train.num_threads was refused as measured on another
    machine, though each row records its count: rows now differ in threads, tables not in machine."""
    import platform

    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    def fake(fn, config, steps):
        return {"measured_peak_bytes": 1000, "baseline_bytes": 0, "measure": "fake", "device": "cpu",
                "vocab_size": 300, "parameters": 200_000, "weights_bytes": 40, "optimizer_state_bytes": 80,
                "losses": [1.0], "threads": config.train.num_threads}

    monkeypatch.setattr(measure, "run_isolated", fake)
    out = tmp_path / "m"
    measure.measure(micro_config(tmp_path, "train.num_threads=1"), parse_method_specs("adamw"), 1, out, "one")
    record = json.loads((out / "memory.json").read_text())
    del record["rows"][0]["measured"]["threads"]  # as rows measured before each recorded its count
    (out / "memory.json").write_text(json.dumps(record))
    md, _ = measure.measure(micro_config(tmp_path, "train.num_threads=2"), parse_method_specs("fira"), 1, out,
                            "two", append=True)
    text = md.read_text()
    assert ", threads per row, torch" in text and "| adamw | 1 | " in text and "| fira | 2 | " in text
    record = json.loads((out / "memory.json").read_text())
    assert [row["measured"]["threads"] for row in record["rows"]] == [1, 2]
    record["machine"] = record["machine"].replace(platform.machine(), "another-cpu")
    (out / "memory.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="was measured with machine 'another-cpu, 2 threads"):
        measure.measure(micro_config(tmp_path, "train.num_threads=1"), parse_method_specs("adamw"), 1, out,
                        "three", append=True)


@pytest.mark.parametrize("platform", ["no_proc_status", "peak_not_resettable"])
def test_a_cpu_peak_that_cannot_be_read_or_reset_is_refused_not_written(tmp_path: Path, monkeypatch, platform):
    """Without /proc/self/status (macOS) a row said 0 bytes; where the peak could not be reset it
    still held the corpus loading before the baseline. Either is now a one-line error."""
    from fira_train import measure
    from tests.fira_train.harness_fixtures import micro_config

    if platform == "no_proc_status":
        monkeypatch.setattr(measure, "current_rss_bytes", lambda: None)
        monkeypatch.setattr(measure, "rss_peak_bytes", lambda: None)
        monkeypatch.setattr(measure, "reset_rss_peak", lambda: False)
    else:
        monkeypatch.setattr(measure, "reset_rss_peak", lambda: False)
    config = micro_config(tmp_path)
    config = measure.replace(config, train=measure.replace(config.train, device="cpu", steps=1))
    with pytest.raises(ValueError, match="resets its peak"):
        measure.measure_run(config, 1)


def test_the_24_gb_column_says_its_unit_beside_peaks_in_gib(tmp_path: Path, monkeypatch) -> None:
    """Peaks are written in GiB and the column tests 24 x 10^9 bytes: a peak of 23.00 GiB
    (24.7 x 10^9 bytes) read "no" with nothing in the table to say why."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 23 * 2 ** 30, "fira": 22 * 2 ** 30}))
    md, _ = measure.measure(micro_config(tmp_path), parse_method_specs("adamw,fira"), 1, tmp_path / "m", "cmd")
    text = md.read_text()
    assert "| adamw | 23.00 GiB |" in text and text.split("| adamw |")[1].split("\n")[0].endswith("| no |")
    assert text.split("| fira |")[1].split("\n")[0].endswith("| yes |")
    assert "fits in 24 GB: a measured peak below 24 GB = 24 x 10^9 bytes (22.35 GiB)" in text


def test_rows_estimated_below_64_mib_are_said_to_measure_the_framework(tmp_path: Path, monkeypatch) -> None:
    """On ``micro`` the process's own memory outweighs the training state the estimate counts:
    the table says which rows that is, rather than leave their ratios to be read as errors."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 2 ** 30, "fira": 2 ** 30}))
    md, json_path = measure.measure(micro_config(tmp_path), parse_method_specs("adamw,fira"), 1, tmp_path / "m", "c")
    rows = json.loads(json_path.read_text())["rows"]
    assert all(row["estimated_bytes"] < measure.SMALL_ESTIMATE for row in rows)
    assert "- Estimated under 64.0 MiB (adamw, fira): " in md.read_text()
    big = {**json.loads(json_path.read_text())}
    big["rows"] = [{**row, "estimated_bytes": measure.SMALL_ESTIMATE} for row in rows]
    assert "Estimated under" not in measure.format_measurement(big)
    # one step is said as one (it read "1 training steps")
    assert md.read_text().startswith("# Measured memory: recipe `micro`, 1 training step\n")
    assert measure.format_measurement({**big, "steps": 3}).startswith("# Measured memory: recipe `micro`, 3 training steps\n")


@pytest.mark.parametrize("spec", ["fira@train.parallel=ddp", "adamw,fira@train.parallel=fsdp2"])
def test_a_spec_that_sets_train_parallel_is_refused_before_any_run(spec: str, tmp_path: Path, monkeypatch) -> None:
    """The command-wide override ``train.parallel=ddp`` was refused in one line, the same key in a
    method spec went to the run's process and came back as a traceback ("needs a process group"),
    after the specs before it were measured."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 1000, "fira": 1000}))
    with pytest.raises(ValueError, match=r"sets train.parallel: memory --measure measures each method in one process"):
        measure.measure(micro_config(tmp_path), parse_method_specs(spec), 1, tmp_path / "m", "cmd")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("append", [False, True])
def test_a_memory_md_it_did_not_write_is_refused_not_replaced(append: bool, tmp_path: Path, monkeypatch) -> None:
    """``--out`` holding a memory.md of the user's (and no memory.json) was written over without a
    word; ``report.md`` of the folder commands is refused so, and so is this now. An empty one,
    and one that ``memory --measure`` wrote, are replaced as before."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 1000}))
    out = tmp_path / "m"
    out.mkdir()
    (out / "memory.md").write_text("# My notes on memory\n\nkeep me\n")
    with pytest.raises(FileExistsError, match=r"holds a memory.md that `fira-train memory --measure` did not write "
                                              r"\(it begins '# My notes on memory'\)"):
        measure.measure(micro_config(tmp_path), parse_method_specs("adamw"), 1, out, "cmd", append=append)
    assert (out / "memory.md").read_text() == "# My notes on memory\n\nkeep me\n"
    assert not (out / "memory.json").exists()
    (out / "memory.md").write_text("")
    measure.measure(micro_config(tmp_path), parse_method_specs("adamw"), 1, out, "cmd", append=append)
    measure.measure(micro_config(tmp_path), parse_method_specs("adamw"), 1, out, "cmd", append=True)
    assert (out / "memory.md").read_text().startswith("# Measured memory")


def test_a_spec_on_a_device_this_machine_lacks_is_refused_before_any_run(tmp_path: Path, monkeypatch) -> None:
    """``adamw,fira@train.device=cuda`` on a machine without CUDA measured adamw (minutes at 350M)
    and only then said that CUDA is not available, leaving an incomplete table."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    calls = []
    monkeypatch.setattr(measure.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(measure, "run_isolated", lambda fn, config, steps: calls.append(config))
    with pytest.raises(ValueError, match=r"train.device='cuda' but CUDA is not available"):
        measure.measure(micro_config(tmp_path), parse_method_specs("adamw,fira@train.device=cuda"), 1,
                        tmp_path / "m", "cmd")
    assert calls == [] and not (tmp_path / "m").exists()


def test_a_cuda_tables_note_says_its_estimate_takes_the_larger_of_activations_and_temporaries(
        tmp_path: Path, monkeypatch) -> None:
    """On CUDA a plain step's estimate is the larger of the activations and the step's temporaries,
    not their sum (:func:`estimate_run_bytes`), but every memory.md said "+ activations + the
    step's temporaries": the breakdown in memory.json did not add up to the estimate it described."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    def fake(fn, config, steps):
        return {"measured_peak_bytes": 1000, "baseline_bytes": 0, "measure": "fake", "device": "cuda",
                "vocab_size": 300, "parameters": 10, "weights_bytes": 40, "optimizer_state_bytes": 80,
                "losses": [1.0]}

    monkeypatch.setattr(measure, "run_isolated", fake)
    md, json_path = measure.measure(micro_config(tmp_path), parse_method_specs("fira"), 1, tmp_path / "m", "c")
    estimate = json.loads(json_path.read_text())["rows"][0]["estimate"]
    parts = sum(value for key, value in estimate.items() if key != "total")
    overlap = min(estimate["activations"], estimate["step_temporaries"])
    assert estimate["total"] == parts - overlap  # what the note has to say
    assert ("on CUDA, outside `optim.step_in_backward`, the larger of the activations and the step's "
            "temporaries, not their sum") in md.read_text()
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"fira": 1000}))  # the CPU's: their sum
    md, _ = measure.measure(micro_config(tmp_path), parse_method_specs("fira"), 1, tmp_path / "cpu", "c")
    assert "on CUDA, outside" not in md.read_text()


def test_a_stopped_measurement_names_the_methods_it_did_not_measure(tmp_path: Path, monkeypatch) -> None:
    """Killed (SIGTERM, no hint printed) or read while it runs, a table without --append said only
    "a command stopped before its last method": which specs to measure again (the hint's "--methods
    cut to those not measured yet") was left to compare by hand with the command line."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"adamw": 1000, "fira": 1000}, stop_at="fira"))
    with pytest.raises(KeyboardInterrupt):
        measure.measure(micro_config(tmp_path), parse_method_specs("adamw,fira,galore"), 1, tmp_path / "m",
                        "fira-train memory --measure --recipe micro --methods adamw,fira,galore")
    record = json.loads((tmp_path / "m" / "memory.json").read_text())
    assert record["complete"] is False and record["missing"] == ["fira", "galore"]
    assert "(incomplete: not measured yet: fira, galore)" in (tmp_path / "m" / "memory.md").read_text()
    monkeypatch.setattr(measure, "run_isolated", _fake_runs({"fira": 1000, "galore": 1000}))
    measure.measure(micro_config(tmp_path), parse_method_specs("fira,galore"), 1, tmp_path / "m",
                    "fira-train memory --measure --recipe micro --methods fira,galore --append", append=True)
    record = json.loads((tmp_path / "m" / "memory.json").read_text())
    assert record["complete"] is True and "missing" not in record
    assert "incomplete" not in (tmp_path / "m" / "memory.md").read_text()


def test_each_measured_step_says_that_it_ran(tmp_path: Path, caplog) -> None:
    """Between "[k/N] spec: 3 steps" and its result nothing was printed: at 1B on the CPU, minutes
    of silence per step, and a run that hung read the same as one that trained."""
    import logging

    from fira_train import measure
    from tests.fira_train.harness_fixtures import micro_config

    config = micro_config(tmp_path, "train.device=cpu", "train.steps=2")
    with caplog.at_level(logging.INFO, logger="fira_train.measure"):
        result = measure.measure_run(config, 2)
    said = [record.getMessage() for record in caplog.records if record.name == "fira_train.measure"]
    assert [line.split(":")[0] for line in said] == ["  step 1 of 2", "  step 2 of 2"]
    assert f"loss {result['losses'][1]:.3f}" in said[1]


def test_measure_under_torchrun_is_refused_before_anything_runs(tmp_path: Path, capsys, monkeypatch) -> None:
    """`torchrun --nproc_per_node 2 -m fira_train memory --measure ...`: each process measured every
    method, side by side (each peak taken beside another measurement, at torchrun's one thread
    per process), and each wrote OUT/memory.md over the other's, printing the table twice."""
    from tests.fira_train.harness_fixtures import write_corpus

    write_corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["memory", "--measure", "--recipe", "micro", "--methods", "adamw", "--steps", "1",
                 "--out", "mem", f"data.source={tmp_path / 'corpus'}", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.vocab_size=300"]) == 1
    assert ("memory --measure measures each method in its own process: launch it in one process, not under "
            "torchrun (2 processes were launched)") in capsys.readouterr().err
    assert not (tmp_path / "mem").exists()


@pytest.mark.parametrize("out", ["corpus", "corpus/memory"])
def test_an_out_that_is_or_lies_in_the_corpus_folder_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                             out: str) -> None:
    """memory.json, written beside the runs' folders after each spec, was read as a document by
    the next spec's run (which lists the corpus leaving out its own folder alone)."""
    from fira_train import measure
    from fira_train.config.method_spec import parse_method_specs
    from tests.fira_train.harness_fixtures import micro_config

    config = micro_config(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "corpus").rglob("*"))
    with pytest.raises(ValueError, match=r"\(--out\) (is|lies inside) the corpus folder .*memory\.json would be read"):
        measure.measure(config, parse_method_specs("adamw,fira"), 1, tmp_path / out)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "corpus").rglob("*")) == before
