"""``fira-train finetune``'s command line: its errors are its own line, nothing before it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _python(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def test_an_error_is_not_preceded_by_bitsandbytes_import_noise(tmp_path: Path) -> None:
    """"Failed to load CPU gemm_4bit_forward from kernels-community ..." came first: bitsandbytes,
    imported by peft through transformers' Trainer, warns at import about 4-bit kernels finetune
    never uses."""
    noisy = _python(["-c", "import logging; logging.basicConfig(); import bitsandbytes"])
    if noisy.returncode != 0 or not noisy.stderr.strip():
        pytest.skip("bitsandbytes is not installed here, or says nothing at import")
    done = _python(["-m", "fira_train", "finetune", "--tasks", "boolq", "--data-dir", str(tmp_path / "none"),
                    "--out", str(tmp_path / "run")])
    assert done.returncode == 1
    assert done.stderr.startswith("fira-train finetune: error: data_dir=") and len(done.stderr.splitlines()) == 1, (
        done.stderr)


def test_a_warning_of_bitsandbytes_after_its_import_still_shows() -> None:
    """Only the import is quiet: the logger's level is back afterwards."""
    import logging

    from fira_train.methods.packages import quiet_import_logs

    logger = logging.getLogger("bitsandbytes")
    before = logger.level
    with quiet_import_logs():
        assert not logger.isEnabledFor(logging.WARNING)
    assert logger.level == before and logger.isEnabledFor(logging.WARNING)


def _args(*argv: str):
    from fira_train.cli import build_parser

    return build_parser().parse_args(["finetune", "--tasks", "boolq", "--data-dir", "d", *argv])


def _checkpoint(folder: Path, step: int) -> None:
    (folder / f"checkpoint-{step}").mkdir(parents=True, exist_ok=True)
    (folder / f"checkpoint-{step}" / "trainer_state.json").write_text(f'{{"global_step": {step}}}')


def test_ctrl_c_says_what_is_kept_and_how_the_same_command_goes_on(tmp_path: Path, monkeypatch) -> None:
    """Stopped before its first checkpoint, a run said its checkpoints were kept and the same command
    continued from the newest (there was none: it starts again); without --out it named "the run's
    folder, under trainer/" rather than the folder."""
    from fira_train.cli import interrupted_hint

    out = tmp_path / "run"
    args = _args("--out", str(out), "--save-steps", "3")
    assert interrupted_hint(args) == ("no checkpoint was written yet (the first comes at step 3, --save-steps): the "
                                      "same command starts the run again from step 0")
    (out / "trainer" / "checkpoint-3").mkdir(parents=True)  # stopped while writing it: not continued
    assert interrupted_hint(args).startswith("no checkpoint was written yet")
    _checkpoint(out / "trainer", 3)
    assert interrupted_hint(args) == (f"checkpoints written so far are kept in {out / 'trainer'} (--save-steps): "
                                      "the same command continues from the newest")
    monkeypatch.chdir(tmp_path)
    _checkpoint(Path("runs/finetune/fira-lora/trainer"), 50)
    assert "kept in runs/finetune/fira-lora/trainer (--save-steps)" in interrupted_hint(_args("--recipe", "released"))
    assert interrupted_hint(_args("--method", "none")) is None  # zero-shot: nothing to continue
    # --save-steps 0: it said only "interrupted", no word that the training so far was lost
    assert interrupted_hint(_args("--out", str(tmp_path / "new"), "--save-steps", "0")) == (
        "no checkpoint is written with --save-steps 0: the training done so far is lost, and the same command "
        "starts the run again from step 0")


def test_a_diverged_run_says_where_its_checkpoints_are_and_that_removing_them_starts_it_over(tmp_path: Path) -> None:
    """It said the checkpoints stayed in OUT (they are in OUT/trainer, and there were none yet) and
    that --overwrite started the run over: --overwrite replaces the results only, and the next start
    with a lower --lr was refused for the checkpoints of the diverged one."""
    from fira_train.user_errors import describe

    out = tmp_path / "run"
    args = _args("--out", str(out))
    diverged = FloatingPointError("the run diverged at step 2: training loss nan (not finite); lower --lr and "
                                  "train the run again")
    line = describe(diverged, args)
    assert line.endswith(f"train the run again (no checkpoint was written in {out / 'trainer'} yet)"), line
    _checkpoint(out / "trainer", 1)
    line = describe(diverged, args)
    assert line.endswith(f"(the checkpoints already written in {out / 'trainer'} stay); remove {out / 'trainer'} "
                         "to start it over"), line
    assert "--overwrite" not in line


def test_flags_the_run_does_not_use_are_a_warning(tmp_path: Path, monkeypatch) -> None:
    """A zero-shot run given training flags went on without a word."""
    import fira_train.finetune.run
    from fira_train.finetune.cli import run_from_args

    ran = []
    monkeypatch.setattr(fira_train.finetune.run, "run_finetune", ran.append)
    with pytest.warns(UserWarning, match=r"^--state-dtype, --lr are not used by a zero-shot run: the run goes on"):
        assert run_from_args(_args("--method", "none", "--state-dtype", "int8", "--lr", "0.1",
                                   "--out", str(tmp_path / "zs"))) == 0
    assert len(ran) == 1  # and it ran


def test_help_shows_the_default_learning_rates_and_ranks_per_method_not_as_a_dict(capsys) -> None:
    """--help printed DEFAULT_LR and DEFAULT_RANK as Python dicts ({'adamw': 5e-05, ...})."""
    from fira_train.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # one line, as argparse wraps it
    assert "{'" not in text and "': " not in text
    assert "(default per method: adamw=5e-05, galore=5e-05, fira=5e-05, lora=0.0005," in text
    assert "rank (default galore=32, fira=32," in text and "none=" not in text


def test_finetune_under_torchrun_is_refused_once_before_anything_is_made(tmp_path: Path, monkeypatch, capsys) -> None:
    """`torchrun --nproc_per_node 2 -m fira_train finetune ...`: each process loaded the model and
    trained the whole run into the same --out, and the second stopped on the lock its peer held:
    "run directory 'OUT' is in use by another fira-train run", printed beside the peer's training."""
    from fira_train.cli import main

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # else rank 1 waits for torchrun's end
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["finetune", "--tasks", "boolq", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "run")]
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == printed, err
        assert ("fira-train finetune: error: finetune trains in one process (it takes no --parallel): launch it "
                "in one process, not under torchrun (2 processes were launched)" in err) is printed, err
    assert not (tmp_path / "run").exists()


def test_every_option_of_the_help_says_what_it_is() -> None:
    """--batch-size, --seed, --lora-r, --cutoff-len and others were listed by --help with their
    metavar alone: neither what they set nor their default."""
    import argparse

    from fira_train.cli import build_parser

    parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["finetune"]
    bare = [action.option_strings[-1] for action in parser._actions
            if action.option_strings and not action.help]
    assert bare == []
    flags = {action.option_strings[-1]: action for action in parser._actions if action.option_strings}
    for flag in ("--batch-size", "--seed", "--lora-r", "--cutoff-len", "--eval-batch-size", "--update-proj-gap"):
        assert f"default {flags[flag].default})" in flags[flag].help, flag


def test_finetune_under_torchrun_is_refused_before_it_loads_transformers(tmp_path: Path, monkeypatch, capsys) -> None:
    """Each process of the launch imported transformers' Trainer (seconds) before it was refused."""
    import sys

    from fira_train.cli import main

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setitem(sys.modules, "fira_train.finetune.run", None)  # importing it raises ImportError
    argv = ["finetune", "--tasks", "boolq", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "run")]
    assert main(argv) == 1
    assert "not under torchrun (2 processes were launched)" in capsys.readouterr().err
