"""fira-train compare: same data, tokens and seed for every method; report and plot."""

from __future__ import annotations

import builtins
import errno
import io
import json
import shutil
from pathlib import Path

import pytest

from fira_train.compare import compare, method_config, parse_methods
from fira_train.run.metrics import read_metrics
from tests.fira_train.harness_fixtures import micro_config  # noqa: F401


def test_compare_runs_every_method_on_the_same_data_and_writes_the_report(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "train.steps=4", "train.eval_every=2", "train.save_every=0")
    out = tmp_path / "cmp"
    report, plot = compare(config, ["fira", "galore", "adamw"], out)
    assert report == out / "report.md" and plot == out / "loss.png"
    text = report.read_text()
    for method in ("fira", "galore", "adamw"):
        assert f"| {method} |" in text
    assert plot.read_bytes()[:4] == b"\x89PNG"
    summaries = {m: json.loads((out / m / "summary.json").read_text()) for m in ("fira", "galore", "adamw")}
    assert {s["tokens"] for s in summaries.values()} == {4 * 8 * 32}
    assert {s["seed"] for s in summaries.values()} == {0}
    assert summaries["fira"]["lr"] == 0.01 and summaries["adamw"]["lr"] == 0.001
    # same initial weights and the same first batch: the loss before any update is identical
    first = {m: read_metrics(out / m)[0]["loss"] for m in summaries}
    assert len(set(first.values())) == 1
    # ... and the methods then differ
    assert len({s["val_loss"] for s in summaries.values()}) == 3
    assert summaries["galore"]["optimizer_state_numel"] < summaries["adamw"]["optimizer_state_numel"]


def test_compare_resume_reuses_finished_runs_and_refuses_silent_overwrite(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=0")
    out = tmp_path / "cmp"
    compare(config, ["adamw"], out)
    stamp = (out / "adamw" / "summary.json").stat().st_mtime_ns
    compare(config, ["adamw"], out, resume=True)
    assert (out / "adamw" / "summary.json").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="--resume"):
        compare(config, ["adamw"], out)
    # a finished run on a corpus that changed since is not kept beside runs on today's data
    summary = json.loads((out / "adamw" / "summary.json").read_text())
    summary["data"]["token_digest"] = "f" * 32
    (out / "adamw" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="trained on other data"):
        compare(config, ["adamw"], out, resume=True)


def test_compare_resume_refuses_what_a_run_cannot_continue_before_any_method_trains(tmp_path: Path) -> None:
    """A memory lever changed on a finished run is refused by that run's own resume (nothing would
    train with it), and so is another setting on an unfinished one: both before the first method
    trains, where each was refused only once the methods before it had trained."""
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=1")
    out = tmp_path / "cmp"
    compare(config, ["fira", "galore", "adamw"], out)
    (out / "fira" / "summary.json").unlink()  # fira as if killed after step 1
    shutil.rmtree(out / "fira" / "checkpoints" / "step_00000002")
    in_backward = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=1",
                               "optim.step_in_backward=true")
    with pytest.raises(ValueError, match=r"--resume: no method was trained: galore \(.*galore\) has "
                                         r"a checkpoint its resume refuses \(cannot resume from step_00000002 with "
                                         r"optim.step_in_backward=False \(now True\): it is the run's last step"):
        compare(in_backward, ["fira", "galore"], out, resume=True)
    assert not (out / "fira" / "summary.json").exists()
    with pytest.raises(ValueError, match=r"no method was trained: fira \(.*\) has optim.gamma=1.01 \(now 1.02\).*; "
                                         r"galore \(.*\) has a checkpoint its resume refuses \(.*optim.step_in_backward"):
        compare(micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=1",
                             "optim.step_in_backward=true", "optim.gamma=1.02"), ["fira", "galore"], out, resume=True)
    assert not (out / "fira" / "summary.json").exists()
    compare(in_backward, ["fira"], out, resume=True)  # stopped before its last step: goes on with it
    assert (out / "fira" / "summary.json").exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_compare_refuses_a_sweeps_folder_overwrite_or_not(tmp_path: Path, overwrite: bool) -> None:
    """It offered --overwrite, which replaced the sweep's report and put the comparison's runs
    beside the sweep's, in a folder that was neither's."""
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=0")
    for files in ({"report.md": "# Learning-rate sweep: recipe `micro`\n", "sweep.json": "{}"}, {"sweep.json": "{}"}):
        out = tmp_path / f"sweep{len(files)}"
        out.mkdir()
        for name, text in files.items():
            (out / name).write_text(text)
        with pytest.raises(FileExistsError, match=r"holds a sweep .*another command's results, which a comparison's "
                                                  r"runs .*--overwrite or not: choose a fresh --out$"):
            compare(config, ["adamw"], out, overwrite=overwrite)
        assert sorted(p.name for p in out.iterdir()) == sorted(files)


@pytest.mark.parametrize("overwrite", [False, True])
def test_compare_refuses_an_analysiss_folder_overwrite_or_not(tmp_path: Path, overwrite: bool) -> None:
    """--overwrite replaced an analysis's report (fira-train analyze) and trained the comparison's
    runs beside, or over, the analysis's, as it did in a sweep's folder."""
    from fira_train.analysis.runs import report_header
    from fira_train.analysis.spikes import TITLE

    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=0")
    report = "\n".join(report_header(TITLE, config, command="fira-train analyze spikes --recipe micro")) + "\n"
    # its report, or (stopped before writing it) a run of it: the run spec is written as the run starts
    for files in ({"report.md": report, "fira/analysis_run.json": "{}"}, {"adamw/analysis_run.json": "{}"}):
        out = tmp_path / f"analysis{len(files)}"
        for name, text in files.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_text(text)
        with pytest.raises(FileExistsError, match=r"holds an analysis .*another command's results, which a "
                                                  r"comparison's runs .*--overwrite or not: choose a fresh --out$"):
            compare(config, ["adamw"], out, overwrite=overwrite)
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(files)
        assert (out / next(iter(files))).read_text() == next(iter(files.values()))


@pytest.mark.parametrize("first_line", ["my notes"])
def test_compare_leaves_a_report_it_did_not_write_alone(tmp_path: Path, first_line: str) -> None:
    # a report of the user's in the same --out: refused before training (another command's: above)
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=0")
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "report.md").write_text(first_line + "\n")
    with pytest.raises(FileExistsError, match=r"report.md that `fira-train compare` did not write.*--overwrite"):
        compare(config, ["adamw"], out)
    assert (out / "report.md").read_text() == first_line + "\n" and not (out / "adamw").exists()
    compare(config, ["adamw"], out, overwrite=True)  # asked for: replaced
    assert (out / "report.md").read_text().startswith("# Pre-training comparison")


def test_a_full_disk_while_the_report_is_written_leaves_the_old_one_and_resume_writes_it(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    """The report was written in place: a full disk left part of it (an empty file at worst), which
    `compare --resume`, the one-line error's advice, then refused as a report it did not write."""
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=0", "train.save_every=0")
    out = tmp_path / "cmp"
    compare(config, ["adamw"], out)
    before = (out / "report.md").read_text()
    real_open = io.open

    def full_disk_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if ("w" in mode or "x" in mode) and Path(file).name.startswith("report.md"):
            def write(text, _write=handle.write):
                _write(text[: len(text) // 2])
                handle.flush()
                raise OSError(errno.ENOSPC, "No space left on device")
            handle.write = write
        return handle

    monkeypatch.setattr(builtins, "open", full_disk_open)
    monkeypatch.setattr(io, "open", full_disk_open)
    with pytest.raises(OSError, match="No space left"):
        compare(config, ["adamw"], out, resume=True)
    monkeypatch.undo()
    assert (out / "report.md").read_text() == before and not (out / "report.md.tmp").exists()
    (out / "report.md").write_text("")  # as a kill between opening and writing left it before
    compare(config, ["adamw"], out, resume=True)
    assert (out / "report.md").read_text() == before



def test_a_corpus_that_cannot_be_read_leaves_no_folder(tmp_path: Path) -> None:
    """--out was made before the data was read: a missing --data left an empty folder."""
    from fira_train.config.overrides import apply_overrides

    config = apply_overrides(micro_config(tmp_path), [f"data.source={tmp_path / 'missing.txt'}"])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        compare(config, ["adamw"], tmp_path / "runs" / "cmp")
    assert not (tmp_path / "runs").exists()

def test_method_config_changes_only_method_and_directory(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "optim.lr=0.003")
    other = method_config(config, "galore", tmp_path / "x")
    assert other.optim.method == "galore" and other.train.out_dir == str(tmp_path / "x" / "galore")
    assert other.optim.lr == 0.003 and other.model == config.model and other.data == config.data


@pytest.mark.parametrize(("text", "message"), [("fira,adamx", "unknown method 'adamx'"),
                                               ("fira,fira", "twice"), (" ", "at least one"),
                                               ("fira,,adamw", "empty entry")])
def test_method_lists_are_checked_before_running(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_methods(text)
    assert parse_methods(" fira, galore ,adamw") == ["fira", "galore", "adamw"]


def test_compare_takes_method_specs(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "train.steps=2", "train.eval_every=2")
    spec = "fira@optim.rank=2@optim.state_dtype=bfloat16"
    report, _ = compare(config, ["fira", spec], tmp_path / "out")
    saved = json.loads((tmp_path / "out" / spec / "config.json").read_text())
    assert saved["optim"]["rank"] == 2 and saved["optim"]["state_dtype"] == "bfloat16"
    assert spec in report.read_text()


def _unshared_micro_batch_worker(rank: int, world: int, root: str) -> list:
    from fira_train.run.launch import SAME_ON_EVERY_RANK

    config = micro_config(Path(root), "train.steps=1", "train.eval_every=0", "train.parallel=ddp")
    try:
        compare(config, ["adamw", "adamw@train.micro_batch_size=1"], Path(root) / "cmp")
    except ValueError as err:
        return [str(err), getattr(err, SAME_ON_EVERY_RANK, False)]
    return []


@pytest.mark.timeout(120)
def test_under_torchrun_a_run_whose_micro_batch_the_processes_cannot_share_is_refused_before_any_trains(
        tmp_path: Path) -> None:
    """`torchrun --nproc_per_node 2 ... compare --methods fira,adamw@train.micro_batch_size=1
    --parallel ddp` trained fira to the end, then stopped at the second run: its micro-batch of one
    sequence does not divide by the 2 processes. The launch's size is known from the start."""
    from tests.multiprocess import run_ranks

    micro_config(tmp_path)  # the corpus, before the workers read it
    for message, marked in run_ranks(_unshared_micro_batch_worker, 2, tmp_path / "w", str(tmp_path), timeout=100):
        assert "train.micro_batch_size=1 (the sequences of one forward pass) must divide by the 2" in message
        assert marked is True
    assert not (tmp_path / "cmp").exists()


def _specs_own_parallel_worker(rank: int, world: int, root: str) -> list:
    config = micro_config(Path(root), "train.steps=2", "train.eval_every=2")  # no --parallel: the specs say it
    compare(config, ["fira@train.parallel=ddp", "adamw@train.parallel=fsdp2"], Path(root) / "cmp")
    import torch.distributed as dist

    dist.barrier()  # rank 0 has written the summaries and the report
    return [json.loads((Path(root) / "cmp" / spec / "summary.json").read_text())["val_loss"]
            for spec in ("fira@train.parallel=ddp", "adamw@train.parallel=fsdp2")]


@pytest.mark.timeout(120)
def test_under_torchrun_specs_of_their_own_parallel_mode_train_in_one_process_group(tmp_path: Path) -> None:
    """`torchrun --nproc_per_node 2 ... compare --methods fira@train.parallel=ddp,adamw@train.parallel=fsdp2`
    (no --parallel) ran each method in a process group of its own: the first trained, the second's
    group could not be made again (gloo "connectFullMesh failed ... Connection refused", a
    traceback). Now one group serves every run, as with --parallel."""
    from tests.multiprocess import run_ranks

    micro_config(tmp_path)  # the corpus, before the workers read it
    losses = run_ranks(_specs_own_parallel_worker, 2, tmp_path / "w", str(tmp_path), timeout=100)
    assert losses[0] == losses[1]
    assert (tmp_path / "cmp" / "report.md").exists()


def test_a_spec_of_its_own_parallel_mode_that_the_launch_refuses_is_named(tmp_path: Path, monkeypatch) -> None:
    """A spec's train.parallel=none under --parallel ddp with 2 processes said "train.parallel is
    'none': pass --parallel ddp" to a user who had passed it."""
    config = micro_config(tmp_path, "train.steps=1", "train.parallel=ddp")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^method spec 'adamw@train.parallel=none': 2 processes were launched "):
        compare(config, ["fira", "adamw@train.parallel=none"], tmp_path / "cmp")
    assert not (tmp_path / "cmp").exists()


def test_compare_with_parallel_in_one_process_is_refused_naming_compare(tmp_path: Path) -> None:
    """`fira-train compare ... --parallel ddp` without torchrun was told to launch
    `torchrun ... -m fira_train pretrain ... --parallel ddp`, another command."""
    config = micro_config(tmp_path, "train.steps=1", "train.parallel=ddp")
    with pytest.raises(ValueError, match=r"needs the processes of a torchrun launch, e\.g\. torchrun "
                                         r"--nproc_per_node 2 -m fira_train pretrain\|compare \.\.\. --parallel ddp"):
        compare(config, ["fira", "adamw"], tmp_path / "cmp")


def test_an_out_that_is_the_corpus_folder_is_not_refused_for_its_report(tmp_path: Path) -> None:
    """compare writes report.md and loss.png beside its runs' folders (each locked, not listed):
    none a document, so the corpus keeps its identity and a --resume reuses the runs. It was
    refused as a run folder that is the corpus."""
    config = micro_config(tmp_path, "train.steps=1", out="corpus")
    compare(config, ["adamw"], tmp_path / "corpus")
    compare(config, ["adamw"], tmp_path / "corpus", resume=True)
    assert (tmp_path / "corpus" / "report.md").is_file()
