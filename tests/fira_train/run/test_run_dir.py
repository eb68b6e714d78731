"""A run directory: one run at a time (a lock held for the run's life, under torchrun too), and
files that fira-train did not write are not written over without --overwrite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fira_train.cli import main
from fira_train.run.metrics import read_metrics
from fira_train.run.train import TrainCallback, train
from tests.fira_train.harness_fixtures import StopBefore, StopRun, micro_config
from tests.multiprocess import run_ranks

REPO = Path(__file__).resolve().parents[3]
LOCK_FILE = ".fira-train.lock"


def _flags(config, method: str = "adamw") -> list[str]:
    return ["--recipe", "micro", "--method", method, "--out", config.train.out_dir,
            "--steps", str(config.train.steps), "--data", config.data.source,
            f"data.cache_dir={config.data.cache_dir}", "data.vocab_size=300", "data.val_fraction=0.1",
            "train.progress=false", "train.tensorboard=false", "train.num_threads=1", "train.eval_every=0",
            f"train.save_every={config.train.save_every}"]


class _SecondRun(TrainCallback):
    """At step 2 of the first run, start a second run into the same OUT: once as a new run with
    --overwrite, once as --resume (the reviewer's two cases); record their exit codes."""

    def __init__(self, config) -> None:
        self.config = config
        self.results: list[tuple[object, str]] = []

    def before_step(self, step, model, optimizer, loss) -> None:
        if step != 2:
            return
        for extra in (["--overwrite"], ["--resume"]):
            try:
                code = main(["pretrain", *_flags(self.config), *extra])
            except Exception as err:  # noqa: BLE001 -- recorded, asserted by the test
                code = err
            self.results.append((code, extra[0]))


def test_a_second_run_into_the_same_out_is_refused_while_the_first_runs(tmp_path: Path, capsys) -> None:
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=4", "train.save_every=1",
                          "train.eval_every=0", "train.keep_last=5")
    second = _SecondRun(config)
    train(config, callbacks=[second])
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert [code for code, _ in second.results] == [1, 1], second.results
    assert len(err) == 2
    for line in err:
        assert f"run directory {str(tmp_path / 'run')!r} is in use by another fira-train run (pid {os.getpid()})" in line
    # the first run's files are its own alone: one record per step, its checkpoints, its config
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["steps"] == 4
    # released at the end: the run resumes (nothing left to do) and starts over
    assert main(["pretrain", *_flags(config), "--resume"]) == 0
    assert main(["pretrain", *_flags(config), "--overwrite"]) == 0


def test_a_run_in_another_process_is_refused(tmp_path: Path) -> None:
    """Two processes: this one holds OUT's lock, `python -m fira_train pretrain` into it stops."""
    from fira_train.run.run_lock import RunLock

    config = micro_config(tmp_path, "train.steps=1")
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "fira_train", "pretrain", *_flags(config)], env=env,
                              capture_output=True, text=True, timeout=240)
    finally:
        lock.release()
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"fira-train pretrain: error: run directory {str(tmp_path / 'run')!r} is in use by another "
        f"fira-train run (pid {os.getpid()}); wait for it to finish, or pass another --out")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_FILE]  # nothing written


class _Boom(Exception):
    pass


class _FailAt(TrainCallback):
    def before_step(self, step, model, optimizer, loss) -> None:
        raise _Boom


def test_the_lock_is_released_when_a_run_fails_and_a_stale_lock_file_blocks_nothing(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", "train.eval_every=0")
    with pytest.raises(_Boom):
        train(config, callbacks=[_FailAt()])
    (tmp_path / "run" / LOCK_FILE).write_text("12345\n")  # left by a killed run: not held by anyone
    train(config, overwrite=True)


def _locked_out_worker(rank: int, world: int, root: str) -> str:
    try:
        train(micro_config(Path(root), "optim.method=adamw", "train.steps=1", "train.parallel=ddp"))
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "trained"


@pytest.mark.timeout(120)
def test_under_torchrun_every_rank_stops_when_out_is_held(tmp_path: Path) -> None:
    """Rank 0 takes the lock and tells the others: every rank of a refused launch stops with the
    same error, none hangs (a plain DDP launch into a free OUT is test_train_parallel's)."""
    from fira_train.run.run_lock import RunLock

    micro_config(tmp_path)  # the corpus, before the workers read it
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    try:
        results = run_ranks(_locked_out_worker, 2, tmp_path / "w", str(tmp_path), timeout=100)
    finally:
        lock.release()
    for result in results:
        assert result.startswith("RunDirectoryBusy: run directory") and "in use" in result, result
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------- files fira-train did not write


def _hugging_face_folder(path: Path) -> dict[str, bytes]:
    path.mkdir(parents=True)
    files = {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode(),
             "model.safetensors": b"\x00" * 64}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def test_a_folder_with_foreign_files_is_not_written_without_overwrite(tmp_path: Path, capsys) -> None:
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", "train.eval_every=0", out="hf")
    files = _hugging_face_folder(tmp_path / "hf")
    for resume in (None, "latest"):
        with pytest.raises(FileExistsError, match=r"did not write \(config\.json, model\.safetensors\).*--overwrite"):
            train(config, resume=resume)
    assert main(["pretrain", *_flags(config)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == files  # untouched, no lock file
    # --overwrite: the run writes its files (its config.json replaces the foreign one), the rest stays
    train(config, overwrite=True)
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["optim"]["method"] == "adamw"


def test_a_file_deleted_while_the_folder_is_read_is_not_foreign(tmp_path: Path, monkeypatch, caplog) -> None:
    """Under a launch, rank 0 deletes the previous run (--overwrite) while the other ranks check the
    folder: one of them listed the run's metrics.jsonl, found it gone, and warned of it as a file
    fira-train did not write (2 launches in about 10). Now such an entry is skipped, and only the
    deleting process warns of foreign files at all."""
    from fira_train.run import run_files
    from fira_train.run.run_dir import prepare_out_dir

    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", "train.eval_every=0")
    out = tmp_path / "run"
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    listed = Path.iterdir

    def iterdir(self):  # metrics.jsonl listed, then deleted before it is looked at
        yield from listed(self)
        if self == out:
            yield out / "metrics.jsonl"

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert run_files.foreign_files(out) == ["notes.txt"]
    for delete, warned in ((False, 0), (True, 1)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            prepare_out_dir(config, out, None, True, delete=delete)
        assert sum("did not write (notes.txt)" in r.getMessage() for r in caplog.records) == warned, delete


def test_a_checkpoints_folder_deleted_while_the_folder_is_read_is_not_an_error(tmp_path: Path, monkeypatch) -> None:
    """The same race as above for checkpoints/: removed by rank 0 (--overwrite) after another rank
    saw it was a folder and before it listed it, it raised FileNotFoundError on that rank (which
    then said "cannot create .../checkpoints for the output folder")."""
    import shutil

    from fira_train.run import run_files

    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000001").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    listed = Path.iterdir

    def iterdir(self):
        if self == out / "checkpoints":
            shutil.rmtree(self)  # rank 0's delete, between is_dir() and the listing
        return listed(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert run_files.foreign_files(out) == ["notes.txt"]


def test_foreign_files_beside_a_run_do_not_block_its_resume(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=2", "train.save_every=1",
                          "train.eval_every=0")
    train(config)
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        train(config)  # a new run: refused (the run is there, and so is a foreign file)
    train(config, resume=1)  # resuming writes only the run's own files
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_a_folder_of_several_runs_is_named_for_what_it_is(tmp_path: Path) -> None:
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", "train.eval_every=0", out="compare")
    (tmp_path / "compare" / "fira").mkdir(parents=True)
    (tmp_path / "compare" / "fira" / "metrics.jsonl").write_text("")
    (tmp_path / "compare" / "report.md").write_text("# Pre-training comparison\n")
    # a sweep's runs, two levels further down
    (tmp_path / "compare" / "adamw" / "lr=0.001" / "seed=0").mkdir(parents=True)
    (tmp_path / "compare" / "adamw" / "lr=0.001" / "seed=0" / "summary.json").write_text("{}")
    for resume in (None, "latest"):  # compare's --out given to pretrain: not "files fira-train did not write"
        with pytest.raises(FileExistsError, match=r"holds runs in folders of their own \(adamw, fira\), as "
                                                  r"compare, sweep"):
            train(config, resume=resume)
    assert sorted(p.name for p in (tmp_path / "compare").iterdir()) == ["adamw", "fira", "report.md"]


def test_the_analyses_files_count_as_fira_trains() -> None:
    from fira_train.run import run_files
    from fira_train.analysis.callbacks import NORMS_FILE
    from fira_train.analysis.runs import RUN_SPEC_FILE
    from fira_train.analysis.similarity import FACTORS_FILE
    from fira_train.run.run_lock import LOCK_FILE as lock_file

    assert {NORMS_FILE, RUN_SPEC_FILE, FACTORS_FILE} <= run_files.ANALYSIS_FILES
    assert lock_file == LOCK_FILE and lock_file in run_files.RUN_FILES


def test_resuming_a_run_of_the_former_tiny_defaults_names_each_setting_to_give(tmp_path: Path) -> None:
    """A tiny Fira run saved at the former default lr (0.01) and without a recorded sign choice
    (aligned then): today's defaults (the tuned 0.02, raw signs) differ, and the refusal says
    which overrides resume it; with them, the configs agree."""
    from fira_train.config.overrides import apply_overrides, config_to_dict
    from fira_train.config.recipes import tiny
    from fira_train.config.resolve import resolved, saved_config
    from fira_train.run.run_dir import config_changes, prepare_out_dir

    out = tmp_path / "run"
    out.mkdir()
    old = config_to_dict(apply_overrides(tiny(), ["optim.lr=0.01"]))
    del old["optim"]["align_signs"]
    (out / "config.json").write_text(json.dumps(old))
    with pytest.raises(ValueError) as err:
        prepare_out_dir(resolved(tiny()), out, "latest", overwrite=False)
    assert "its config.json has optim.align_signs=" in str(err.value) and ", optim.lr=0.01 (now " in str(err.value)
    assert "resumes with optim.lr=0.01" in str(err.value) and "resumes with optim.align_signs=true" in str(err.value)
    given = resolved(apply_overrides(tiny(), ["optim.lr=0.01", "optim.align_signs=true"]))
    assert config_changes(saved_config(old), given) == []
    prepare_out_dir(given, out, "latest", overwrite=False)  # no error


def test_a_relora_run_recorded_before_the_default_rewarmup_changed_says_how_it_resumes(tmp_path: Path) -> None:
    from fira_train.config.overrides import apply_overrides, config_to_dict
    from fira_train.config.recipes import tiny
    from fira_train.config.resolve import resolved
    from fira_train.run.run_dir import prepare_out_dir

    out = tmp_path / "run"
    out.mkdir()
    old = config_to_dict(resolved(apply_overrides(tiny(), ["optim.method=relora"])))
    old["optim"].update(relora_every=None, relora_rewarmup=None)  # recorded unresolved, 2% of a cycle then
    (out / "config.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"optim.relora_rewarmup=1 \(now 10\).*resumes with optim.relora_rewarmup=1"):
        prepare_out_dir(resolved(apply_overrides(tiny(), ["optim.method=relora"])), out, "latest", overwrite=False)
    prepare_out_dir(resolved(apply_overrides(tiny(), ["optim.method=relora", "optim.relora_rewarmup=1"])), out,
                    "latest", overwrite=False)  # no error


def test_a_moved_cache_does_not_block_a_resume_or_a_reuse() -> None:
    """Where the tokens are cached changes no token: the data record (token digest) is what a
    resume and a reuse compare."""
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import tiny
    from fira_train.run.run_dir import config_changes

    here, there = tiny(), apply_overrides(tiny(), ["data.cache_dir=/elsewhere"])
    assert config_changes(here, there) == []
    assert config_changes(here, apply_overrides(tiny(), ["data.vocab_size=1024"])) == ["data.vocab_size"]


def test_a_local_corpus_named_by_another_path_to_it_is_the_same_source(tmp_path: Path, monkeypatch) -> None:
    """``--data corpus.txt`` resumed as ``--data /abs/corpus.txt`` (or the other way round) was
    refused as another data.source: the strings were compared as typed."""
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.recipes import tiny
    from fira_train.run.run_dir import config_changes

    (tmp_path / "corpus.txt").write_text("text")
    monkeypatch.chdir(tmp_path)

    def source(value: str):
        return apply_overrides(tiny(), [f"data.source={value}"])

    assert config_changes(source("corpus.txt"), source(str(tmp_path / "corpus.txt"))) == []
    assert config_changes(source("c4:."), source(f"c4:{tmp_path}")) == []
    assert config_changes(source("corpus.txt"), source("other.txt")) == ["data.source"]
    assert config_changes(source("wiki"), source("corpus.txt")) == ["data.source"]


def test_resuming_with_another_method_names_the_method_not_the_lr(tmp_path: Path) -> None:
    from fira_train.config.overrides import apply_overrides, config_to_dict
    from fira_train.config.recipes import tiny
    from fira_train.config.resolve import resolved
    from fira_train.run.run_dir import prepare_out_dir

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config_to_dict(resolved(tiny()))))  # a fira run
    with pytest.raises(ValueError) as err:
        prepare_out_dir(resolved(apply_overrides(tiny(), ["optim.method=adamw"])), out, "latest", overwrite=False)
    assert "optim.method='fira' (now 'adamw')" in str(err.value)
    assert str(err.value).endswith("the run was made with --method fira") and "resumes with optim.lr" not in str(err.value)


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_is_no_change_of_device_and_the_runs_record_decides(tmp_path: Path, monkeypatch, cuda: bool) -> None:
    """A run recorded as train.device=auto resumes (and is reused) with train.device=cpu, and the
    other way round, on any machine: auto names no kind, so the device the run trained on (its
    summary, its checkpoint's environment) decides. Before, any change of the word was refused;
    then auto was read as what it means here, so a CPU run recorded as auto could not go on with
    cpu on a GPU machine. cpu against cuda stays a change."""
    import torch

    from fira_train.config.overrides import apply_overrides, config_to_dict
    from fira_train.config.recipes import tiny
    from fira_train.config.resolve import resolved
    from fira_train.run.run_dir import config_changes, finished_with, prepare_out_dir

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    auto, cpu, gpu = tiny(), apply_overrides(tiny(), ["train.device=cpu"]), apply_overrides(tiny(), ["train.device=cuda"])
    assert auto.train.device == "auto"
    assert config_changes(auto, cpu) == config_changes(cpu, auto) == config_changes(auto, gpu) == []
    assert config_changes(cpu, gpu) == ["train.device"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config_to_dict(resolved(auto))))
    prepare_out_dir(resolved(cpu), run, "latest", overwrite=False)  # no error
    (run / "summary.json").write_text(json.dumps({"device": "cpu"}))  # an auto run that trained on the CPU
    assert finished_with(cpu, run)
    (run / "summary.json").write_text(json.dumps({"device": "cuda:0"}))  # one that trained on a GPU
    with pytest.raises(ValueError, match=r"trained on 'cuda:0', and train.device='cpu' trains on 'cpu' here"):
        finished_with(cpu, run)


@pytest.mark.parametrize("with_run", [True, False], ids=["beside-a-run", "no-run"])
def test_overwrite_leaves_foreign_files_under_checkpoints(tmp_path: Path, with_run: bool) -> None:
    """--overwrite into a folder whose checkpoints/ holds another tool's files (``--out .`` in a
    project with its own checkpoints/, a Lightning ``epoch=3.ckpt``): they are listed as files
    fira-train did not write, and the warning says they are left as they are; the whole
    checkpoints/ folder was deleted with them. Now only fira-train's checkpoint folders go."""
    from fira_train.run import run_files
    from fira_train.run.run_dir import prepare_out_dir

    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", "train.eval_every=0")
    out = tmp_path / "run"
    theirs = out / "checkpoints" / "epoch=3.ckpt"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"weights of another tool")
    (out / "checkpoints" / "best").mkdir()
    (out / "checkpoints" / "best" / "model.safetensors").write_bytes(b"more")
    ours = [out / "checkpoints" / name for name in ("step_00000001", ".tmp-step_00000002-77", ".old-step_00000001")]
    if with_run:
        for path in ours:
            path.mkdir()
            (path / "state.pt").write_bytes(b"x")
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run_files.foreign_files(out) == ["checkpoints/best", "checkpoints/epoch=3.ckpt"]
    prepare_out_dir(config, out, None, True)
    assert theirs.read_bytes() == b"weights of another tool"
    assert (out / "checkpoints" / "best" / "model.safetensors").read_bytes() == b"more"
    assert not any(path.exists() for path in ours) and not (out / "metrics.jsonl").exists()
    assert run_files.previous_run(out) == []  # theirs stays, and is no run: the run writes beside it


def test_overwrite_removes_a_checkpoints_folder_that_held_only_the_runs(tmp_path: Path) -> None:
    from fira_train.run.run_dir import prepare_out_dir

    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", "train.eval_every=0")
    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000001").mkdir(parents=True)
    prepare_out_dir(config, out, None, True)
    assert not (out / "checkpoints").exists()


def test_overwrite_leaves_foreign_files_under_tb(tmp_path: Path, caplog) -> None:
    """tb/ was taken as fira-train's whole, unlooked at: ``--overwrite`` into a folder with a
    tb/ of the user's (other runs' logs in folders of their own) deleted it without a warning.
    Now what is not an event file of the run's writer is listed as foreign, and left."""
    from fira_train.run import run_files
    from fira_train.run.run_dir import prepare_out_dir

    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=1", "train.eval_every=0")
    out = tmp_path / "run"
    (out / "tb" / "baseline").mkdir(parents=True)
    (out / "tb" / "baseline" / "events.out.tfevents.1.host.1.0").write_bytes(b"their curve")
    (out / "tb" / "notes.txt").write_text("mine")
    ours = out / "tb" / "events.out.tfevents.1700000000.host.42.0"
    ours.write_bytes(b"the run's curve")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run_files.foreign_files(out) == ["tb/baseline", "tb/notes.txt"]
    with caplog.at_level("WARNING"):
        prepare_out_dir(config, out, None, True)
    assert "tb/baseline, tb/notes.txt" in caplog.text
    assert (out / "tb" / "baseline" / "events.out.tfevents.1.host.1.0").read_bytes() == b"their curve"
    assert (out / "tb" / "notes.txt").read_text() == "mine"
    assert not ours.exists() and not (out / "metrics.jsonl").exists()
    ours.write_bytes(b"the run's curve")
    (out / "tb" / "notes.txt").unlink()
    shutil.rmtree(out / "tb" / "baseline")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    prepare_out_dir(config, out, None, True)
    assert not (out / "tb").exists()  # held the run's events alone


def test_continuing_a_run_is_checked_against_the_checkpoint_it_resumes_from(tmp_path: Path) -> None:
    """A sitting resumed from an earlier step with a memory lever changed, and stopped before its
    next save, rewrote config.json but not the run's last checkpoint. compare --resume, sweep
    --reuse and analyze --reuse compared the lever against config.json: they refused the
    continuation that the last checkpoint's record allows, and accepted the one it refuses. Now
    they say what the run's own --resume says."""
    from fira_train.config.overrides import apply_overrides
    from fira_train.config.resolve import resolved
    from fira_train.run.run_dir import continue_refusal

    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=4", "train.save_every=2",
                          "train.keep_last=5", "train.eval_every=0")
    lever = apply_overrides(config, ["train.activation_checkpointing=true"])
    out = tmp_path / "run"
    train(config)
    (out / "summary.json").unlink()  # stopped after its last checkpoint, before the summary
    with pytest.raises(StopRun):
        train(lever, resume=2, callbacks=[StopBefore(3)])
    assert json.loads((out / "config.json").read_text())["train"]["activation_checkpointing"] is True

    refusal = continue_refusal(out, resolved(lever))
    assert refusal is not None and "train.activation_checkpointing=False (now True): it is the run's last step" in refusal
    with pytest.raises(ValueError, match=r"activation_checkpointing=False \(now True\): it is the run's last step"):
        train(lever, resume="latest")  # what the pre-check now says before any run trains
    assert continue_refusal(out, resolved(config)) is None
    assert train(config, resume="latest")["steps"] == 4  # which the pre-check refused


def test_a_run_without_an_intact_checkpoint_is_left_to_its_own_resume(tmp_path: Path) -> None:
    """The pre-check of compare --resume, sweep --reuse and analyze --reuse raised the damage of a
    run whose every checkpoint is damaged, so no run of the sweep trained; the run's own resume
    raises it, and a sweep's other runs still finish first."""
    from fira_train.config.resolve import resolved
    from fira_train.run.checkpoint import CheckpointError
    from fira_train.run.run_dir import continue_refusal

    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=4", "train.save_every=2",
                          "train.keep_last=5", "train.eval_every=0")
    out = tmp_path / "run"
    train(config)
    (out / "summary.json").unlink()  # stopped after its last checkpoint, before the summary
    for state in (out / "checkpoints").glob("step_*/state.pt"):
        with open(state, "r+b") as handle:
            handle.seek(100)
            handle.write(b"garbage")
    assert continue_refusal(out, resolved(config)) is None
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        train(config, resume="latest")
