"""fira-train analyze: sub-commands, flags and overrides reach the analyses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fira_train.cli import build_parser, main
from tests.fira_train.analysis.analysis_fixtures import corpus_root  # noqa: F401
from tests.fira_train.harness_fixtures import write_corpus  # noqa: F401


def _data_flags(root: Path) -> list[str]:
    corpus = root / "corpus"
    if not corpus.exists():
        write_corpus(corpus)
    return [f"data.source={corpus}", f"data.cache_dir={root / 'cache'}", "data.vocab_size=300",
            "data.val_fraction=0.1", "train.progress=false", "train.tensorboard=false", "train.num_threads=1",
            "train.eval_every=0", "train.save_every=0"]


def test_every_analysis_is_a_subcommand() -> None:
    parser = build_parser()
    for name in ("similarity", "rank-sweep", "gap-sweep", "ablation", "spikes", "noise", "variance"):
        args = parser.parse_args(["analyze", name])
        assert callable(args.func)
    args = parser.parse_args(["analyze", "noise", "--steps", "7", "--jobs", "3", "train.batch_size=4"])
    assert args.recipe == "tiny" and args.steps == 7 and args.overrides == ["train.batch_size=4"]
    assert args.jobs == 3 and parser.parse_args(["analyze", "ablation"]).jobs == 1


def test_analyze_noise_runs_reuses_and_records_the_command(tmp_path: Path, corpus_root: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "noise"
    argv = ["analyze", "noise", "--recipe", "micro", "--out", str(out), "--steps", "2", "--seed", "3",
            "--methods", "adamw", "--scale", "0.001", *_data_flags(corpus_root)]
    assert main(argv) == 0
    assert "report:" in capsys.readouterr().out
    assert json.loads((out / "adamw" / "config.json").read_text())["train"]["seed"] == 3
    report = (out / "report.md").read_text()
    assert "fira-train analyze noise --recipe micro" in report and "2 steps" in report
    stamp = (out / "adamw-noise" / "summary.json").stat().st_mtime_ns
    assert main([*argv, "--reuse"]) == 0
    assert (out / "adamw-noise" / "summary.json").stat().st_mtime_ns == stamp
    assert main(argv) == 1  # the runs exist: neither --reuse nor --overwrite
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["analyze", "ablation", "--gammas", "1.1,x"], "--gammas must be comma-separated numbers"),
    (["analyze", "rank-sweep", "--ranks", "4,a"], "--ranks must be comma-separated integers"),
    (["analyze", "gap-sweep", "--seeds", "0,x"], "--seeds must be comma-separated integers"),
    (["analyze", "noise", "--methods", " "], "--methods must list at least one entry"),
    (["analyze", "noise", "--methods", "adamw,,fira"], "--methods 'adamw,,fira' has an empty entry"),
    (["analyze", "rank-sweep", "--ranks", "4,8,4"], "--ranks gives '4' twice"),
    (["analyze", "gap-sweep", "--gaps", "4,04"], "--gaps gives 4 twice"),
    (["analyze", "ablation", "--gammas", "inf,Infinity"], "--gammas gives inf twice"),
    (["analyze", "gap-sweep", "--reuse", "--overwrite", "--gaps", "3"], "--reuse keeps finished runs and --overwrite"),
    (["analyze", "rank-sweep", "--ranks", "4", "optim.rank=8"], "optim.rank=8 would be replaced"),
    (["analyze", "similarity", "--ranks", "4", "optim.rank=8"], "optim.rank=8 would be replaced"),
    (["analyze", "gap-sweep", "--gaps", "3", "--seed", "4", "--seeds", "1,2"], "--seed 4 would be replaced"),
    (["analyze", "gap-sweep", "--gaps", "3", "--seed", "0", "--seeds", "1,2"], "--seed 0 would be replaced"),
    (["analyze", "gap-sweep", "--gaps", "3", "--seeds", "1,2", "train.seed=0"], "train.seed=0 would be replaced"),
    (["analyze", "rank-sweep", "--ranks", "4", "optim.rank = 8"], "optim.rank = 8 would be replaced"),
    (["analyze", "noise", "train.out_dir=elsewhere"], "train.out_dir: an analysis writes each run"),
    (["analyze", "noise", "--steps", "5", "train.steps=9"], "train.steps is given twice, by --steps 5"),
    (["analyze", "noise", "optim.step_in_backward=true"], "adds noise to each step's gradients and records"),
    (["analyze", "spikes", "optim.step_in_backward=true"], "records each step's gradient norm, which optim.step"),
    (["analyze", "spikes", "--steps", "1"], "spikes needs at least 2 steps per run (--steps)"),  # before training
    (["analyze", "gap-sweep", "--steps", "5", "--gaps", "6"], "gaps (--gaps) must be ints in [1, steps=5] (--steps)"),
    # the defaults, not given: said to be the defaults, and what to give instead
    (["analyze", "gap-sweep", "--steps", "20"], "got 25 (of the default gaps 3,6,12,25,50: give --gaps up to 20, "
                                                "or more --steps)"),
    (["analyze", "spikes", "--jobs", "0"], "jobs (--jobs) must be an int >= 1, got jobs=0"),
    # an empty --seeds was taken for none given: the recipe's seed trained, without a word
    (["analyze", "gap-sweep", "--gaps", "3", "--seeds", ""], "--seeds must list at least one entry, got ''"),
    (["analyze", "gap-sweep", "--gaps", "3", "--seeds=-1"], "seeds (--seeds) must be ints >= 0, got -1"),
    # sweep's and compare's method specs: read as a method name, "unknown method" beside "fira" in the list
    (["analyze", "rank-sweep", "--ranks", "4", "--methods", "galore,fira@optim.alpha=0.1"],
     "--methods: 'fira@optim.alpha=0.1' is a method spec (NAME@key=value); analyze takes method names: set "
     "optim.alpha=0.1 for every run as a key=value override"),
    (["analyze", "ablation", "--variants", "fira@optim.gamma=1.1@optim.rank=4"], "--variants: 'fira@optim.gamma="),
    # an unknown or unfit method named the method alone, not the flag of the four that gave it
    (["analyze", "rank-sweep", "--ranks", "4", "--methods", "fira,foo"], "--methods: unknown method 'foo' in 'fira,foo'"),
    (["analyze", "ablation", "--variants", "foo"], "--variants: unknown method 'foo' in 'foo'; valid methods: adamw"),
    (["analyze", "spikes", "--limiter-runs", "fira,bar"], "--limiter-runs: unknown method 'bar'"),
    (["analyze", "spikes", "--galore-runs", "bar"], "--galore-runs: unknown method 'bar'"),
    (["analyze", "noise", "--methods", "bar"], "--methods: unknown method 'bar'"),
    (["analyze", "gap-sweep", "--gaps", "3", "--methods", "bar"], "--methods: unknown method 'bar'"),
    (["analyze", "rank-sweep", "--ranks", "4", "--methods", "adamw"], "method 'adamw' has no rank (--methods)"),
    (["analyze", "gap-sweep", "--gaps", "3", "--methods", "adamw"], "method 'adamw' refreshes no projection (--methods)"),
])
def test_bad_lists_name_the_flag(argv: list[str], message: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture) -> None:
    assert main([*argv, "--recipe", "micro", "--out", str(tmp_path / "x")]) == 1
    assert message in capsys.readouterr().err


def test_analyze_variance_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "variance"
    assert main(["analyze", "variance", "--samples", "200", "--steps", "20", "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "fira-train analyze variance --samples 200" in text
    assert (out / "variance.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["analyze", "variance", "--samples", "200", "--steps", "20", "--out", str(out)]) == 0  # its own


def test_analyze_variance_leaves_another_report_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "report.md").write_text("# My notes\n")
    assert main(["analyze", "variance", "--samples", "200", "--steps", "20", "--out", str(tmp_path)]) == 1
    assert "`fira-train analyze variance` did not write" in capsys.readouterr().err
    assert (tmp_path / "report.md").read_text() == "# My notes\n" and not (tmp_path / "variance.png").exists()
    assert main(["analyze", "variance", "--seed", "-1", "--out", str(tmp_path / "v")]) == 1
    assert "seed must be an int >= 0, got seed=-1" in capsys.readouterr().err
    assert main(["analyze", "variance", "--steps", "3", "--out", str(tmp_path / "v")]) == 1  # was matplotlib's
    assert "steps must be an int >= 5 (--steps)" in capsys.readouterr().err
    # an empty --out fell back to the default folder under the working directory
    assert main(["analyze", "variance", "--out", ""]) == 1
    assert "--out '' names no folder" in capsys.readouterr().err


def test_default_ranks_follow_the_recipes_width() -> None:
    from fira_train.analysis.rank_defaults import RANK_SWEEP_FRACTIONS, SIMILARITY_FRACTIONS, ranks_for_width

    assert ranks_for_width(256, RANK_SWEEP_FRACTIONS) == (4, 16, 64, 128)  # the paper's rank study
    assert ranks_for_width(256, SIMILARITY_FRACTIONS) == (16, 128)
    assert ranks_for_width(64, RANK_SWEEP_FRACTIONS) == (1, 4, 16, 32)  # micro
    assert ranks_for_width(64, SIMILARITY_FRACTIONS) == (4, 32)
    assert ranks_for_width(2, (0.001, 0.999)) == (1,)  # rounded into [1, d_model)
    parser = build_parser()
    assert parser.parse_args(["analyze", "rank-sweep"]).ranks is None  # chosen once the recipe is known
    assert parser.parse_args(["analyze", "similarity", "--ranks", "8,48"]).ranks == "8,48"


@pytest.mark.parametrize(("analysis", "ranks"), [("rank-sweep", (1, 4, 16, 32)), ("similarity", (4, 32))])
def test_rank_analyses_run_on_micro_without_a_ranks_flag(analysis: str, ranks: tuple[int, ...], tmp_path: Path,
                                                         corpus_root: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / analysis
    extra = ["--methods", "fira"] if analysis == "rank-sweep" else []  # 1 method x 4 ranks: seconds
    assert main(["analyze", analysis, "--recipe", "micro", "--out", str(out), "--steps", "2", *extra,
                 *_data_flags(corpus_root)]) == 0, capsys.readouterr().err
    assert sorted(int(p.name.rsplit("-r", 1)[1]) for p in out.glob("fira-r*")) == list(ranks)
    report = (out / "report.md").read_text()
    if analysis == "rank-sweep":
        assert "| r = 1 | r = 4 | r = 16 | r = 32 |" in report and "d_model 64" in report
    else:
        assert "r/d_model = 4/64" in report and "r/d_model = 32/64" in report


def test_explicit_ranks_are_checked_as_before(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["analyze", "rank-sweep", "--recipe", "micro", "--ranks", "4,65", "--out", str(tmp_path / "x")]) == 1
    assert "ranks (--ranks) must be ints in [1, d_model=64]" in capsys.readouterr().err
    # d_model itself: full rank, Fira-only-scaling's alone (the default methods include fira and galore)
    assert main(["analyze", "rank-sweep", "--recipe", "micro", "--ranks", "4,64", "--out", str(tmp_path / "x")]) == 1
    assert "rank 64 (--ranks) is d_model, full rank" in capsys.readouterr().err


@pytest.mark.parametrize("analysis", [["variance", "--samples", "200", "--steps", "20"],
                                      ["noise", "--recipe", "micro", "--steps", "2"]])
def test_an_analysis_under_torchrun_is_refused_before_anything_runs(analysis: list[str], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture,
                                                                     monkeypatch) -> None:
    """`torchrun --nproc_per_node 2 -m fira_train analyze variance --out OUT`: both processes wrote
    OUT's files, and one stopped with "OUT/variance.png.tmp: No such file or directory", the other's
    temporary file renamed under it; a training analysis's runs each refused the launch ("pass
    --parallel ddp"), which analyze does not take."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["analyze", *analysis, "--out", str(tmp_path / "out")]) == 1
    assert ("analyze runs in one process (its runs each in their own): launch it in one process, not under "
            "torchrun (2 processes were launched)") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
