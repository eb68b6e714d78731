"""The command line: help, flags -> config, pretrain / compare / memory / methods, errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fira_train import cli
from fira_train.cli import build_parser, config_from_args, main, resume_request
from tests.fira_train.harness_fixtures import micro_config  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


def _data_flags(tmp_path: Path) -> list[str]:
    config = micro_config(tmp_path)  # writes the corpus
    return ["--data", config.data.source, f"data.cache_dir={config.data.cache_dir}", "data.vocab_size=300",
            "data.val_fraction=0.1", "train.progress=false", "train.tensorboard=false", "train.num_threads=1"]


def test_python_dash_m_help_works() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "fira_train", "--help"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("pretrain", "compare", "sweep", "memory", "finetune", "analyze"):
        assert command in proc.stdout


def test_the_parser_is_built_without_importing_torch() -> None:
    """`fira-train --help` and argument errors answer at once: torch is imported when a command runs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    code = "import sys; from fira_train.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_flags_and_overrides_map_onto_the_config() -> None:
    args = build_parser().parse_args([
        "pretrain", "--recipe", "micro", "--method", "galore", "--rank", "8", "--update-proj-gap", "3",
        "--lr", "0.02", "--seed", "5", "--steps", "7", "--save-every", "2", "--eval-every", "3",
        "--data", "/some/folder", "--out", "runs/x", "train.batch_size=16",
    ])
    config = config_from_args(args)
    assert config.recipe == "micro" and config.optim.method == "galore"
    assert (config.optim.rank, config.optim.update_proj_gap, config.optim.lr) == (8, 3, 0.02)
    assert (config.train.seed, config.train.save_every, config.train.eval_every) == (5, 2, 3)
    assert config.data.source == "/some/folder" and config.train.out_dir == "runs/x"
    assert (config.train.batch_size, config.train.steps) == (16, 7)
    assert not args.resume and args.resume_step is None


@pytest.mark.parametrize(("flags", "override", "message"), [
    (["--steps", "7"], "train.steps=9", "train.steps is given twice, by --steps 7 and by the override 'train.steps=9'"),
    ([], " optim.method = adamw", "optim.method is given twice, by --method galore and by the override "
                                  "'optim.method = adamw'"),
    (["--update-proj-gap", "3"], "optim.update_proj_gap=3", "by --update-proj-gap 3"),  # even the same value
])
def test_a_flag_and_an_override_of_one_key_are_refused(flags: list[str], override: str, message: str) -> None:
    """Which of the two won would depend on nothing the user wrote: argparse keeps no order between them."""
    args = build_parser().parse_args(["pretrain", "--recipe", "micro", "--method", "galore", *flags, override])
    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_args(args)


@pytest.mark.parametrize("argv", [
    ["compare", "--methods", "fira,adamw"],
    ["memory", "--measure", "--methods", "fira"],
    ["sweep", "--methods", "fira", "--lrs", "0.01"],
])
@pytest.mark.parametrize("override", ["optim.method=galore", "train.out_dir=elsewhere"])
def test_commands_with_methods_refuse_what_each_run_sets(argv: list[str], override: str, tmp_path: Path,
                                                          capsys) -> None:
    """Each method spec's run sets its method and folder: a command-wide override of them was dropped."""
    assert main([*argv, "--recipe", "micro", "--out", str(tmp_path / "o"), override]) == 1
    err = capsys.readouterr().err
    assert f"{override.partition('=')[0]}: " in err and "sets it" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("argv", "spec", "message"), [
    (["compare", "--methods", "fira,{spec}"], "adamw@train.steps=10", "compare trains every method on the same data"),
    (["compare", "--methods", "fira,{spec}"], "galore@data.seq_len=16", "sets data.seq_len: compare trains"),
    (["compare", "--methods", "fira,{spec}"], "adamw@train.seed=3", "sets train.seed: compare trains"),
    (["sweep", "--methods", "{spec}", "--lrs", "0.01"], "adamw@train.batch_size=2", "the sweep trains every method"),
    (["memory", "--measure", "--steps", "2", "--methods", "{spec}"], "galore@train.steps=10",
     "memory --measure trains 2 steps of every method"),
])
def test_a_spec_cannot_change_what_the_methods_share(argv: list[str], spec: str, message: str, tmp_path: Path,
                                                     capsys) -> None:
    """A report that says 'same data, tokens and seed' (or a table of N steps) would be false."""
    argv = [a.replace("{spec}", spec) for a in argv]
    assert main([*argv, "--recipe", "micro", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert f"method spec {spec!r} sets {spec.split('@')[1].split('=')[0]}" in err and message in err
    assert not (tmp_path / "o" / "memory.json").exists() and not (tmp_path / "o" / "report.md").exists()


@pytest.mark.parametrize("argv", [
    ["compare", "--methods", "{specs}"],
    ["sweep", "--methods", "{specs}", "--lrs", "0.01"],
    ["memory", "--measure", "--methods", "{specs}"],
])
def test_specs_spelling_one_run_two_ways_are_refused_before_a_run(argv: list[str], tmp_path: Path, capsys) -> None:
    """`fira@optim.rank=4,fira@optim.rank=04` trained (or measured) the same run twice."""
    argv = [a.replace("{specs}", "fira@optim.rank=4,adamw,fira@optim.rank=04") for a in argv]
    assert main([*argv, "--recipe", "micro", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "--methods: 'fira@optim.rank=4' and 'fira@optim.rank=04' are the same run" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_overrides_may_stand_anywhere_among_the_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(["pretrain", "train.eval_every=3", "--recipe", "micro", "train.batch_size=4", "--method",
                              "galore", "--rank", "8", "train.steps=5", "--out", "runs/x"])
    assert args.overrides == ["train.eval_every=3", "train.batch_size=4", "train.steps=5"]  # command-line order
    config = config_from_args(args)
    assert (config.train.steps, config.train.batch_size, config.optim.rank, config.train.eval_every) == (5, 4, 8, 3)
    assert config.optim.method == "galore" and config.train.out_dir == "runs/x"
    args = parser.parse_args(["compare", "--recipe", "micro", "optim.alpha=0.5", "--methods", "fira,adamw"])
    assert args.methods == "fira,adamw" and args.overrides == ["optim.alpha=0.5"]
    args = parser.parse_args(["analyze", "noise", "train.batch_size=4", "--recipe", "micro", "--steps", "2"])
    assert (args.recipe, args.steps, args.overrides) == ("micro", 2, ["train.batch_size=4"])
    with pytest.raises(SystemExit):  # an unknown flag is still refused
        parser.parse_args(["pretrain", "--recipe", "micro", "train.steps=3", "--bogus", "--method", "fira"])
    with pytest.raises(SystemExit):  # and a required one still required
        parser.parse_args(["pretrain", "train.steps=3", "--method", "fira"])


@pytest.mark.parametrize("command", [["compare", "--recipe", "micro"], ["sweep", "--recipe", "micro", "--lrs", "0.01",
                                                                       "--out", "o"],
                                     ["memory", "--measure", "--recipe", "micro"]])
@pytest.mark.parametrize("again", ["--methods", "--method"])  # --method: argparse's abbreviation of --methods
def test_methods_given_twice_is_refused(command, again, capsys) -> None:
    """argparse kept the last value: `compare --methods fira --method adamw` trained adamw alone."""
    parser = build_parser()
    assert parser.parse_args([*command, "--methods", "fira,galore"]).methods == "fira,galore"
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--methods", "fira", again, "adamw"])
    err = capsys.readouterr().err
    assert "argument --methods: given twice (--methods 'fira', then --method" in err and "'adamw'" in err


def test_resume_flag_values() -> None:
    parser = build_parser()
    base = ["pretrain", "--recipe", "micro", "--method", "fira"]
    assert resume_request(parser.parse_args(base)) is None
    assert resume_request(parser.parse_args(base + ["--resume", "train.steps=3"])) == "latest"
    assert resume_request(parser.parse_args(base + ["--resume-step", "40"])) == 40
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--resume-step", "soon"])
    with pytest.raises(ValueError, match="--resume-step"):
        resume_request(parser.parse_args(base + ["--resume-step", "-2"]))
    for resume in (["--resume"], ["--resume-step", "4"]):  # continue and start anew at once: refused
        with pytest.raises(ValueError, match="give one of them"):
            resume_request(parser.parse_args(base + resume + ["--overwrite"]))


def test_pretrain_end_to_end(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    code = main(["pretrain", "--recipe", "micro", "--method", "adamw", "--steps", "3", "--out", str(out),
                 *_data_flags(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "validation perplexity" in printed and str(out) in printed
    assert (out / "metrics.jsonl").exists() and (out / "config.json").exists()
    # the same command again is refused; --resume continues (here: nothing left to do)
    assert main(["pretrain", "--recipe", "micro", "--method", "adamw", "--steps", "3", "--out", str(out),
                 *_data_flags(tmp_path)]) == 1
    assert "--resume" in capsys.readouterr().err
    assert main(["pretrain", "--recipe", "micro", "--method", "adamw", "--steps", "3", "--out", str(out),
                 "--resume", *_data_flags(tmp_path)]) == 0


def test_compare_end_to_end_prints_report_and_plot(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cmp"
    code = main(["compare", "--recipe", "micro", "--methods", "fira,adamw", "--steps", "2", "--out", str(out),
                 "--eval-every", "0", *_data_flags(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert f"report: {out / 'report.md'}" in printed and f"plot:   {out / 'loss.png'}" in printed
    assert "| fira |" in printed and "| adamw |" in printed
    assert "fira-train compare --recipe micro --methods fira,adamw" in (out / "report.md").read_text()


def test_errors_are_one_line_messages(tmp_path: Path, capsys) -> None:
    assert main(["pretrain", "--recipe", "micro", "--method", "adamx", "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "adamx" in err and "fira" in err and "galore" in err and "Traceback" not in err
    assert main(["pretrain", "--recipe", "nano", "--method", "fira"]) == 1
    assert "unknown recipe 'nano'" in capsys.readouterr().err
    assert main(["pretrain", "--recipe", "micro", "--method", "fira", "train.stepz=3"]) == 1
    assert "train.stepz" in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    (["--resume"], "sweep takes --reuse to continue where it stopped, not --resume"),
    (["--lr", "0.1"], "use --lrs and --seeds, not --lr / --seed"),
    (["train.seed=3"], "train.seed: sweep sets it itself"),
    (["--lrs", "adamw:0.1,x"], "--lrs adamw: 'x' is not a number"),
    (["--seeds", "0,0"], "--seeds gives '0' twice"),
])
def test_sweep_refuses_what_it_sets_itself(tmp_path: Path, capsys, extra: list[str], message: str) -> None:
    argv = ["sweep", "--recipe", "micro", "--methods", "adamw", "--lrs", "0.01", "--out", str(tmp_path / "s"), *extra]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_memory_prints_the_memory_table(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "memory_table", lambda: [{"size": "60m", "method": "fira"}])
    monkeypatch.setattr(cli, "format_memory_table", lambda rows: f"TABLE {rows[0]['size']} {rows[0]['method']}")
    assert main(["memory"]) == 0
    out = capsys.readouterr().out
    assert "\n\nTABLE 60m fira\n" in out and "| 7b | adamw |" in out  # then the run estimates
    # the first table came without a word: its totals (BF16, no activations: 0.40 GB for Fira at
    # 60M) read as contradicting the captioned second one's (fp32 with activations: 1.00 GB)
    assert out.startswith("The paper's memory estimate (Table 2, appendix C.1): weights + gradients + "
                          "optimizer states, every element in BF16, no activations")


def test_methods_lists_the_registry(capsys) -> None:
    assert main(["methods"]) == 0
    printed = capsys.readouterr().out
    for name in ("adamw", "fira", "galore", "lora", "relora", "adam-mini", "frugal"):
        assert f"\n{name} " in "\n" + printed
    assert "reads" not in printed
    assert main(["methods", "--settings"]) == 0
    lines = capsys.readouterr().out.splitlines()
    adamw = lines.index(next(line for line in lines if line.startswith("adamw ")))
    assert lines[adamw + 1].split() == ["reads", "optim.betas,", "optim.eps,", "optim.weight_decay"]


def test_ctrl_c_says_what_is_kept_instead_of_a_traceback(tmp_path, monkeypatch, capsys) -> None:
    import fira_train.run.train

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    from fira_train.run import checkpoint as ckpt

    monkeypatch.setattr(fira_train.run.train, "train", interrupted)
    ckpt.save_checkpoint(tmp_path, 2, {"step": 2})  # a run with a checkpoint (without one: the test below)
    assert main(["pretrain", "--method", "adamw", "--recipe", "micro", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == ("fira-train pretrain: interrupted; checkpoints written so far are kept "
                           "(train.save_every): the same command with --resume continues from the newest")


def test_ctrl_c_without_out_speaks_of_the_default_folder(tmp_path, monkeypatch, capsys) -> None:
    """Without --out, pretrain and compare stopped before their first checkpoint said the checkpoints
    written so far were kept (the folder as given was none, so not known): the default folder is
    the one they wrote, and it held none."""
    import fira_train.compare
    import fira_train.run.train

    def interrupted(config, *args, **kwargs):  # the run's folder made, stopped before a checkpoint
        Path(config.train.out_dir).mkdir(parents=True)
        raise KeyboardInterrupt

    def compare_interrupted(config, methods, out_dir, **kwargs):
        (Path(out_dir) / methods[0]).mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fira_train.run.train, "train", interrupted)
    monkeypatch.setattr(fira_train.compare, "compare", compare_interrupted)
    assert main(["pretrain", "--method", "adamw", "--recipe", "micro"]) == 130
    assert "interrupted; no checkpoint was written yet" in capsys.readouterr().err
    assert main(["compare", "--recipe", "micro", "--methods", "adamw,fira"]) == 130
    assert "interrupted; nothing was kept yet" in capsys.readouterr().err


#: A command whose first Ctrl-C (a real SIGINT, sent by the command to itself) is followed by a
#: second: while the command's line is made ("hint"), or during the interpreter's exit, from an
#: exit handler ("exit"), as torch's, multiprocessing's and tqdm's are.
_TWO_CTRL_C = """
import atexit, os, signal, sys, time
from fira_train import cli

def second_ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)  # where the KeyboardInterrupt of that signal is raised, unless it is ignored

def interrupted(args):
    os.kill(os.getpid(), signal.SIGINT)  # the first: its KeyboardInterrupt is raised at once
    time.sleep(30)
    raise AssertionError("no KeyboardInterrupt")

if sys.argv[1] == "hint":
    hint = cli.interrupted_hint
    cli.interrupted_hint = lambda args: (second_ctrl_c(), hint(args))[1]
else:
    atexit.register(second_ctrl_c)
cli._pretrain = interrupted
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("second", ["hint", "exit"])
def test_a_second_ctrl_c_while_the_command_ends_is_ignored(second: str, tmp_path: Path) -> None:
    """Ctrl-C pressed twice (or `timeout -s INT`, which signals the process and then its group)
    printed the interrupted line, then a KeyboardInterrupt traceback from wherever the second one
    landed: torch's exit handlers, multiprocessing's join of a run's process, or the line itself
    ("During handling of the above exception")."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    argv = ["pretrain", "--recipe", "micro", "--method", "adamw", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, "-c", _TWO_CTRL_C, second, *argv], env=env, capture_output=True,
                          text=True, timeout=100)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130, done.stderr
    assert done.stderr.splitlines() == [
        "fira-train pretrain: interrupted; no checkpoint was written yet (the first comes at train.save_every): the "
        "same command with --resume starts the run again from step 0"]


def test_a_run_process_killed_says_what_is_kept_and_how_to_continue(tmp_path, monkeypatch, capsys) -> None:
    """A compare or sweep whose run process was killed (SIGTERM by a scheduler, the OOM killer)
    said "the isolated run of train ended without a result": a function's name, and no word of
    the checkpoints kept or of --resume, which Ctrl-C's line gives."""
    import fira_train.compare
    from fira_train.run.isolated import IsolatedRunDied

    def killed(*args, **kwargs):
        raise IsolatedRunDied("the run's process (pid 7) ended without a result: killed by SIGTERM")

    monkeypatch.setattr(fira_train.compare, "run_isolated", killed)
    assert main(["compare", "--methods", "adamw", "--recipe", "micro", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (
        "fira-train compare: error: the run's process (pid 7) ended without a result: killed by SIGTERM: what it "
        "printed above says why; fix that if it was not stopped on purpose and run the same command again with "
        f"--resume (nothing was kept in {tmp_path} yet: no run finished and no checkpoint was written, so the "
        "command starts again from the beginning)")


@pytest.mark.parametrize(("argv", "expected"), [
    (["pretrain", "--recipe", "micro", "--method", "fira", "--overwrite"],
     "with --resume (instead of --overwrite) continues"),
    (["pretrain", "--recipe", "micro", "--method", "fira", "--resume-step", "40"],
     "with --resume (instead of --resume-step) continues"),
    (["compare", "--recipe", "micro", "--methods", "fira"],
     "with --resume continues from the newest, and compare keeps the finished runs"),
    # an --out not there: the start stopped before it wrote anything (its lock removed the folder it made)
    (["sweep", "--recipe", "micro", "--out", "o", "--methods", "fira", "--lrs", "0.01"],
     "nothing was kept yet (no run finished, and the first checkpoint comes at train.save_every): the same command "
     "with --reuse starts again from the beginning"),
    (["analyze", "noise", "--overwrite"],
     "with --reuse (instead of --overwrite) continues the others from their newest"),
    (["finetune", "--tasks", "boolq", "--data-dir", "d"],  # no checkpoint in runs/finetune/fira/trainer
     "no checkpoint was written yet (the first comes at step 50, --save-steps): the same command starts"),
    (["finetune", "--tasks", "boolq", "--data-dir", "d", "--save-steps", "0"],  # no checkpoints kept: said
     "no checkpoint is written with --save-steps 0: the training done so far is lost, and the same command starts "
     "the run again from step 0"),
    (["finetune", "--tasks", "boolq", "--data-dir", "d", "--steps", "0"], None),
    (["analyze", "variance"], None), (["methods"], None), (["memory"], None),
])
def test_each_command_says_how_to_continue_after_ctrl_c(argv: list[str], expected: str | None, tmp_path: Path,
                                                        monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default folders are relative: none of this checkout's runs/
    hint = cli.interrupted_hint(build_parser().parse_args(argv))
    assert hint is None if expected is None else expected in hint


def test_ctrl_c_while_a_new_runs_data_is_built_does_not_offer_resume(tmp_path: Path, monkeypatch, capsys) -> None:
    """Stopped as the data was built, --overwrite over a finished run: the hint said --resume
    (instead of --overwrite) continues from the newest checkpoint, the earlier run's."""
    from fira_train.run import train as train_module

    out = tmp_path / "o"
    argv = ["pretrain", "--recipe", "micro", "--method", "adamw", "--steps", "2", "--out", str(out),
            *_data_flags(tmp_path)]
    assert main(argv) == 0
    capsys.readouterr()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "build_corpus", interrupted)
    assert main([*argv, "--overwrite", "optim.lr=0.002"]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"fira-train pretrain: interrupted; the run stopped while its data was built, before it wrote "
                    f"anything in {out}; what --overwrite replaces there is not deleted yet: the same command "
                    "starts it again")
    assert (out / "summary.json").is_file()


def test_a_sweep_stopped_with_a_finished_run_says_the_same_command_continues(tmp_path: Path) -> None:
    out = tmp_path / "o"
    args = build_parser().parse_args(["sweep", "--recipe", "micro", "--out", str(out), "--methods", "fira",
                                      "--lrs", "0.01"])
    (out / "fira" / "lr=0.01" / "seed=0").mkdir(parents=True)
    (out / "fira" / "lr=0.01" / "seed=0" / "summary.json").write_text("{}")
    assert cli.interrupted_hint(args) == "finished runs and checkpoints are kept: the same command with --reuse continues"


def test_a_run_stopped_before_its_first_checkpoint_says_it_starts_again(tmp_path: Path) -> None:
    """Ctrl-C, or a divergence, before the first checkpoint (train.save_every): the lines said the
    checkpoints written so far were kept and --resume continued from the newest; there were none,
    and --resume starts from step 0."""
    from argparse import Namespace

    from fira_train.run import checkpoint as ckpt
    from fira_train.user_errors import describe

    out = tmp_path / "run"
    args = build_parser().parse_args(["pretrain", "--recipe", "micro", "--method", "fira", "--out", str(out)])
    # no folder: the start stopped before it wrote anything (its lock removed the folder it made);
    # it said the checkpoints written so far were kept
    assert cli.interrupted_hint(args) == ("no checkpoint was written yet (the first comes at train.save_every): "
                                          "the same command with --resume starts the run again from step 0")
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    assert cli.interrupted_hint(args) == ("no checkpoint was written yet (the first comes at train.save_every): "
                                          "the same command with --resume starts the run again from step 0")
    diverged = describe(FloatingPointError("the run diverged at step 2: training loss 1e9"), args)
    assert f"(no checkpoint was written in {out} yet)" in diverged and "already written" not in diverged
    ckpt.save_checkpoint(out, 1, {"step": 1})
    assert "checkpoints written so far are kept" in cli.interrupted_hint(args)
    assert f"(the checkpoints already written in {out} stay)" in describe(
        FloatingPointError("the run diverged at step 2: training loss 1e9"), args)
    # compare's folder holds its runs in OUT/<spec>/ (the test below): a pretrain run there is none of them
    other = Namespace(command="compare", out=str(out), overrides=[])
    assert f"(nothing was kept in {out} yet" in describe(FloatingPointError("the run diverged at step 2: loss"), other)


@pytest.mark.parametrize(("argv", "run", "flag"), [
    (["compare", "--recipe", "micro", "--methods", "fira,adamw"], "adamw", "--resume"),
    (["sweep", "--recipe", "micro", "--methods", "fira", "--lrs", "0.01,0.03"], "fira/lr=0.03/seed=0", "--reuse"),
    (["analyze", "noise"], "fira-noise", "--reuse"),
])
def test_compare_sweep_and_analyze_stopped_before_keeping_anything_say_so(argv: list[str], run: str, flag: str,
                                                                          tmp_path: Path) -> None:
    """Stopped (Ctrl-C, a run's process killed) before any of their runs wrote a checkpoint or
    finished, they said the checkpoints (and finished runs) were kept and the same command
    continued: nothing was, and it starts again from the beginning."""
    from fira_train.run import checkpoint as ckpt
    from fira_train.run.isolated import IsolatedRunDied
    from fira_train.user_errors import describe

    out = tmp_path / "out"
    args = build_parser().parse_args([*argv, "--out", str(out)])
    args.argv = [*argv, "--out", str(out)]
    killed = IsolatedRunDied("the run's process (pid 7) ended without a result: killed by SIGTERM")
    # no folder: the start stopped before it wrote anything (its lock removed the folder it made)
    assert cli.interrupted_hint(args) == (
        "nothing was kept yet (no run finished, and the first checkpoint comes at train.save_every): the same "
        f"command with {flag} starts again from the beginning")
    (out / run).mkdir(parents=True)
    (out / run / "metrics.jsonl").write_text("")  # started, not checkpointed
    (out / "report.md").write_text("")
    assert cli.interrupted_hint(args) == (
        "nothing was kept yet (no run finished, and the first checkpoint comes at train.save_every): the same "
        f"command with {flag} starts again from the beginning")
    assert describe(killed, args).endswith(
        f"run the same command again with {flag} (nothing was kept in {out} yet: no run finished and no "
        "checkpoint was written, so the command starts again from the beginning)")
    ckpt.save_checkpoint(out / run, 1, {"step": 1})  # a checkpoint of one of its runs
    assert "nothing" not in cli.interrupted_hint(args) and f"with {flag} continues" in cli.interrupted_hint(args)
    assert describe(killed, args).endswith(f"with {flag} (the checkpoints already written in {out} stay)")
    shutil.rmtree(out / run / ckpt.CHECKPOINT_DIR)
    (out / run / ckpt.CHECKPOINT_DIR / ".tmp-step_00000002-7").mkdir(parents=True)  # a save cut short: nothing
    assert "nothing was kept yet" in cli.interrupted_hint(args)
    for ended in ("summary.json", "diverged.json"):  # a finished run; a sweep's diverged one, kept as diverged
        (out / run / ended).write_text("{}")
        assert "nothing" not in cli.interrupted_hint(args)
        (out / run / ended).unlink()


def test_memory_measure_says_what_it_kept_after_ctrl_c(tmp_path: Path) -> None:
    """Stopped in its first method, it said the methods measured so far were kept in a memory.json
    that did not exist (the advised --append then had nothing to add to)."""
    out = tmp_path / "mem"
    args = build_parser().parse_args(["memory", "--measure", "--recipe", "micro", "--methods", "fira,adamw",
                                      "--out", str(out)])
    assert cli.interrupted_hint(args) == "no method was measured yet: the same command measures them all"
    out.mkdir()
    (out / "memory.json").write_text("{}")
    assert f"kept in {out}/memory.json: the same command with --append" in cli.interrupted_hint(args)
    # the table names what it has not measured (missing): the hint gives the --methods to run, where
    # it said "its --methods cut to those not measured yet" and left the cutting to the user
    (out / "memory.json").write_text(json.dumps({"rows": [], "complete": False, "missing": ["adamw"]}))
    assert cli.interrupted_hint(args) == (f"the methods measured so far are kept in {out}/memory.json: the same "
                                          "command with --append and --methods adamw measures the rest")
    (out / "memory.json").write_text("not json")  # a damaged one: the general hint, not an error
    assert "its --methods cut to those not measured yet" in cli.interrupted_hint(args)


@pytest.mark.parametrize("extra", [["--steps", "5"], ["--data", "x"], ["--rank", "4"], ["--save-every", "2"],
                                   ["--seed", "1"], ["--overwrite"], ["train.batch_size=2"]])
def test_sweep_report_only_refuses_every_other_setting(extra: list[str], tmp_path: Path, capsys) -> None:
    """It rebuilds the report from sweep.json: a setting given beside it would be ignored."""
    assert main(["sweep", "--report-only", "--out", str(tmp_path), *extra]) == 1
    err = capsys.readouterr().err
    assert "takes only --out" in err and (extra[0] if extra[0].startswith("--") else "key=value") in err


def test_help_offers_what_each_command_takes(capsys) -> None:
    for argv in (["sweep", "--help"], ["compare", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = capsys.readouterr().out
        assert "%%" not in text and "fira_train pretrain" not in text
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    text = capsys.readouterr().out
    assert "95% interval" in text
    for refused in ("--lr ", "--seed ", "--resume", "--overwrite", "--parallel"):  # sweep refuses them
        assert refused not in text, refused
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "fira_train compare ... --parallel" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("argv", "warned"), [
    (["pretrain", "--method", "adamw", "--rank", "8"], "optim.rank is not used by adamw"),
    (["pretrain", "--method", "sgd", "optim.update_proj_gap=3"], "optim.update_proj_gap is not used by sgd"),
    (["compare", "--methods", "adamw,adam-mini", "--rank", "8"], "optim.rank is not used by adamw, adam-mini"),
    (["compare", "--methods", "adamw,fira", "--rank", "8"], None),  # fira takes it
    (["pretrain", "--method", "adamw"], None),  # the recipe's own rank: not given
    (["pretrain", "--method", "galore", "optim.gamma=1.05"], "optim.gamma is not used by galore: it has no "
                                                            "effect on this run"),
    (["pretrain", "--method", "fira", "optim.gamma=1.05", "optim.lora_alpha=8"], "optim.lora_alpha is not used"),
    (["pretrain", "--method", "fira", "optim.gamma=1.05", "--lr", "0.02"], None),
    (["compare", "--methods", "fira,galore@optim.gamma=1.05"], "optim.gamma is not used by galore: it has no "
                                                               "effect on the run galore@optim.gamma=1.05"),
    (["compare", "--methods", "fira@optim.gamma=1.05,galore"], None),
    (["compare", "--methods", "adamw,relora", "optim.relora_prune=0.5"], None),
    # a misspelt key is the config's error alone (it was warned of first, as if it were a setting)
    (["compare", "--methods", "fira,galore@optim.rnak=4"], None),
    (["pretrain", "--method", "galore", "optim.rnak=4"], None),
])
def test_a_setting_given_to_methods_that_ignore_it_is_warned(argv: list[str], warned: str | None, caplog) -> None:
    args = build_parser().parse_args([*argv, "--recipe", "micro"])
    methods = [args.method] if argv[0] == "pretrain" else args.methods.split(",")
    with caplog.at_level("WARNING"):
        cli.warn_unused_settings(args, methods)
    assert (f"fira-train {argv[0]}: warning: {warned}" in caplog.text) if warned else not caplog.text
    if warned:
        assert len(caplog.records) == 1


@pytest.mark.parametrize("argv", [["pretrain", "--method", "adamw", "--rank", "8"],
                                  ["compare", "--methods", "fira,galore@optim.gamma=1.05"]])
def test_under_torchrun_an_unused_setting_is_warned_by_rank_0_alone(argv: list[str], monkeypatch, caplog) -> None:
    """Every process of a torchrun launch is given the same command line: the warning was printed
    once per process. A lone process with RANK left in its environment still warns."""
    args = build_parser().parse_args([*argv, "--recipe", "micro"])
    methods = [args.method] if argv[0] == "pretrain" else args.methods.split(",")
    for world, rank, warned in (("2", "1", False), ("2", "0", True), (None, "1", True), ("1", "1", True)):
        if world is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", world)
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level("WARNING"):
            cli.warn_unused_settings(args, methods)
        assert len(caplog.records) == warned, (world, rank)


def test_python_dash_m_finetune_is_the_command_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """Ctrl-C and errors there are the command's one line (they were tracebacks)."""
    import runpy

    import fira_train.finetune.run

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(fira_train.finetune.run, "run_finetune", interrupted)
    monkeypatch.setattr(sys, "argv", ["fira_train.finetune", "--tasks", "boolq", "--data-dir", str(tmp_path),
                                      "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("fira_train.finetune", run_name="__main__")
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "fira-train finetune: interrupted; no checkpoint was written yet" in err


def test_a_reader_that_stops_reading_ends_the_command_quietly() -> None:
    """``fira-train methods | head -1``: no "error: Broken pipe" line (it blamed the output folder)."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "fira_train", "methods", "--settings"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # before the command writes a line
    err = process.stderr.read().decode()
    assert process.wait() == 141, err
    assert err == ""


def test_a_broken_pipe_of_anything_but_stdout_is_an_error(monkeypatch, capsys) -> None:
    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_methods", broken)
    assert main(["methods"]) == 1
    assert "fira-train methods: error: " in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "prog"), [
    (["pretrain", "--recipe", "micro", "--method", "fira", "--stpes", "5"], "fira-train pretrain"),
    (["compare", "--recipe", "micro", "--methods", "fira", "--resume-step", "3"], "fira-train compare"),
    (["analyze", "spikes", "--recipe", "micro", "--bogus"], "fira-train analyze spikes"),
])
def test_an_unknown_flag_is_named_with_its_commands_usage(argv: list[str], prog: str, capsys) -> None:
    """It was the top level's usage ('usage: fira-train [-h] COMMAND ...', 'fira-train: error')."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: {prog} " in err and f"{prog}: error: unrecognized arguments: {argv[-2] if argv[-1].isdigit() else argv[-1]}" in err


def test_a_key_value_given_to_a_command_without_overrides_says_it_takes_flags(capsys) -> None:
    """finetune takes no config overrides: 'optim.state_dtype=int8' (pretrain's spelling) was refused
    as an unrecognized argument alone, without a word of where its settings are."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["finetune", "--tasks", "boolq", "--data-dir", "d", "optim.state_dtype=int8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert ("fira-train finetune: error: unrecognized arguments: optim.state_dtype=int8 (fira-train finetune takes "
            "no key=value config overrides: its settings are its flags, listed by fira-train finetune --help)") in err
    with pytest.raises(SystemExit):  # a command that takes overrides: argparse's line as it was
        cli.main(["pretrain", "--recipe", "micro", "--method", "fira", "--bogus", "train.steps=2"])
    assert capsys.readouterr().err.rstrip().endswith("unrecognized arguments: --bogus")


@pytest.mark.parametrize(("given", "named"), [
    (["--lrs", "-0.001,0.001"], "--lrs: '-0.001' must be a positive finite number"),
    (["--lrs", "-1e-3"], "--lrs: '-1e-3' must be a positive finite number"),
    (["--lrs", "0.001", "--seeds", "-1,2"], "--seeds: '-1' must be >= 0"),
])
def test_a_negative_number_in_a_sweep_list_is_named_as_a_value(given: list[str], named: str, capsys) -> None:
    """argparse took '-0.001,0.001' for a flag and said only '--lrs: expected one argument'."""
    assert cli.main(["sweep", "--recipe", "micro", "--methods", "adamw", "--out", "unused", *given]) == 1
    assert named in capsys.readouterr().err


def test_a_sweep_without_its_grid_names_what_is_missing(capsys) -> None:
    assert cli.main(["sweep", "--recipe", "micro", "--methods", "fira", "--out", "unused"]) == 1
    assert "sweep needs --lrs (with --recipe, --methods and --lrs it trains" in capsys.readouterr().err


def test_a_library_warning_is_one_line_in_the_commands_words(monkeypatch, capsys) -> None:
    """Python printed two lines: the file of fira-train that raised it, and its source line."""
    import warnings

    before = warnings.formatwarning

    def methods(args):
        print(warnings.formatwarning("rank=1000 is >= min(m, n)", UserWarning, "/x/optimizers.py", 150), end="",
              file=sys.stderr)
        return 0

    monkeypatch.setattr(cli, "_methods", methods)
    assert cli.main(["methods"]) == 0
    assert capsys.readouterr().err == "fira-train methods: warning: rank=1000 is >= min(m, n) (UserWarning)\n"
    assert warnings.formatwarning is before  # put back: the process's own warnings are Python's again


@pytest.mark.parametrize("argv", [
    ["pretrain", "--recipe", "micro", "--method", "fira", "train.stepz=3"],  # a bad key=value
    ["pretrain", "--recipe", "nano", "--method", "fira"],  # a bad recipe name
    ["pretrain", "--recipe", "micro", "--method", "adamx"],  # a bad method name
    ["pretrain", "--recipe", "micro", "--method", "fira", "--resume", "--overwrite"],
    ["compare", "--recipe", "micro", "--methods", "fira,fira"],
    # refused by compare itself, before it trains
    ["compare", "--recipe", "micro", "--methods", "fira@optim.rank=4,fira@optim.rank=04"],
    ["compare", "--recipe", "micro", "--methods", "fira@train.seed=3,adamw"],
    ["compare", "--recipe", "micro", "--methods", "fira@optim.rank=x,adamw"],
    ["compare", "--recipe", "micro", "--methods", "adamw,lora", "--parallel", "ddp"],
    # a setting the method fixes otherwise (refused by the config, before the model is built)
    ["pretrain", "--recipe", "micro", "--method", "fira-released", "optim.align_signs=true"],
])
def test_under_torchrun_a_command_line_error_is_printed_by_rank_0_alone(argv, monkeypatch, capsys) -> None:
    """Every process of a torchrun launch is given the same command line and raised the same
    error: it was printed once per process. Now rank 0 prints it; every rank exits with status 1."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # else the other rank waits for torchrun's end
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(argv) == 1
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"fira-train {argv[0]}: error: ") and err.count("\n") == 1, err


def test_under_torchrun_several_processes_without_parallel_are_refused_by_rank_0_alone(tmp_path: Path, monkeypatch,
                                                                                        capsys) -> None:
    """A launch of several processes without --parallel is refused by train() in every process alike:
    it was printed once per process."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["pretrain", "--recipe", "micro", "--method", "adamw", "--out", str(tmp_path / "run")]
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert ("train.parallel is 'none': pass --parallel ddp" in err) is printed, err
        assert err.count("\n") == printed
    assert not (tmp_path / "run").exists()


def test_under_torchrun_an_argparse_error_is_printed_by_rank_0_alone(monkeypatch, capsys) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exited:
            main(["pretrain", "--recipe", "micro", "--method", "fira", "--stepz", "3"])
        assert exited.value.code == 2
        assert ("unrecognized arguments: --stepz" in capsys.readouterr().err) is printed


def test_under_torchrun_an_error_of_one_process_is_printed_by_that_process(monkeypatch, capsys) -> None:
    """What does not come from the command line alone (a full disk, a rank's own failure) may
    differ between processes: each that raises it says so."""
    import errno

    def full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "runs/x/metrics.jsonl")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cli, "_pretrain", full)
    assert main(["pretrain", "--recipe", "micro", "--method", "fira"]) == 1
    assert "no space left" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["pretrain", "--recipe", "nano", "--method", "fira"],
                                  ["pretrain", "--recipe", "micro", "--method", "fira", "--stepz"]])
def test_under_torchrun_another_rank_waits_for_rank_0_to_say_it_then_says_it_itself(argv, monkeypatch,
                                                                                     capsys) -> None:
    """torchrun ends the other processes as soon as one fails: a rank 1 that exited silently at once
    could have rank 0 ended before it printed. So rank 1 waits, for torchrun to end it; still alive
    after the wait, it prints the error itself."""
    waits = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setattr(cli.time, "sleep", waits.append)
    try:
        status = main(argv)
    except SystemExit as exited:  # argparse's refusal
        status = exited.code
    assert status in (1, 2) and waits == [cli.RANK_ZERO_GRACE_S]
    assert "error: " in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_torchrun_launch_with_a_bad_override_prints_its_error_once() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "fira_train",
                           "pretrain", "--recipe", "micro", "--method", "fira", "--parallel", "ddp", "train.stepz=3"],
                          env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    assert proc.stderr.count("fira-train pretrain: error: unknown config key 'train.stepz'") == 1, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_torchrun_launch_warns_of_its_config_once(tmp_path: Path) -> None:
    """A setting no method reads (the command line's) and a rank above every matrix's size (the
    optimizer's): each was printed once per process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "fira_train",
                           "pretrain", "--recipe", "micro", "--method", "fira", "--rank", "1000", "optim.lora_alpha=8",
                           "--parallel", "ddp", "--out", str(tmp_path / "run"), "train.steps=1", *_data_flags(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("optim.lora_alpha is not used by fira") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("warning: param_groups[1]: rank=1000 is >= min(m, n)") == 1, proc.stderr[-3000:]


@pytest.mark.parametrize("argv", [["pretrain", "--recipe", "nano", "--method", "fira"],
                                  ["pretrain", "--recipe", "micro", "--method", "fira", "--stepz", "3"]])
def test_a_lone_process_with_rank_set_prints_its_command_line_error(argv, monkeypatch, capsys) -> None:
    """RANK left in the environment of one process (no launch of several: WORLD_SIZE unset or 1)
    has no rank 0 to leave the error to: it exited with status 1 or 2 and said nothing."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "1")
    for world in (None, "1"):
        if world is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", world)
        try:
            status = main(argv)
        except SystemExit as exited:  # argparse's refusal
            status = exited.code
        assert status in (1, 2)
        assert "error: " in capsys.readouterr().err, world
