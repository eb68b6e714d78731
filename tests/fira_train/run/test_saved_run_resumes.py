"""A checkpoint written by an earlier version of the harness resumes, and continues the same run."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from fira_train.cli import main
from fira_train.run.metrics import read_metrics

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "micro_fira_run"
#: The command that wrote ``FIXTURE/run`` (see its README), without ``--out``.
COMMAND = ["pretrain", "--recipe", "micro", "--method", "fira", "--steps", "6", "--save-every", "3",
           "--eval-every", "3", "data.source=corpus", "data.cache_dir=cache", "data.vocab_size=300",
           "data.val_fraction=0.1", "train.progress=false", "train.tensorboard=false",
           "train.num_threads=1", "train.keep_last=2"]
#: The defaults of the version that wrote it, where they have changed since.
THEN = ["data.test_fraction=0", "optim.align_signs=true", "data.epoch_order=1"]


def test_a_checkpoint_of_an_earlier_version_resumes_the_same_run(tmp_path: Path, monkeypatch, caplog,
                                                                   capsys) -> None:
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)  # the saved config names corpus/, cache/ and run/ relative to it
    recorded = read_metrics("run")  # the earlier version's uninterrupted run: steps 1 to 6
    assert [r["step"] for r in recorded] == [1, 2, 3, 4, 5, 6]

    # It predates the held-out test split, the raw-sign default and the epoch seeds drawn from
    # (seed, epoch): today's defaults would train another run, so resuming needs the settings it
    # was made with, and the refusal names all three.
    assert main([*COMMAND, "--out", "run", "--resume"]) == 1
    err = capsys.readouterr().err
    assert "resumes with data.test_fraction=0" in err and "resumes with optim.align_signs=true" in err
    assert "resumes with data.epoch_order=1" in err
    with caplog.at_level(logging.INFO):
        assert main([*COMMAND, *THEN, "--out", "run", "--resume"]) == 0
    assert any("from step 3" in message for message in caplog.messages)
    resumed = read_metrics("run")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert resumed[:3] == recorded[:3]  # the steps before the checkpoint are kept as written
    assert sorted(p.name for p in Path("run/checkpoints").iterdir()) == ["step_00000003", "step_00000006"]

    assert main([*COMMAND, *THEN, "--out", "fresh"]) == 0  # uninterrupted, by this version
    fresh = read_metrics("fresh")
    for key in ("lr", "tokens"):
        assert [r[key] for r in resumed[3:]] == [r[key] for r in fresh[3:]]
    # The same losses bit for bit where this machine computes steps 1-3 as the one that wrote the
    # checkpoint did (then the weights it resumes from are the ones this version reaches). Another
    # CPU's kernels may round differently in the last bits (seen between an AMD and an Intel CPU,
    # both AVX512): then they agree to round-off, as with the earlier version's own losses.
    exact = ([r["loss"] for r in fresh[:3]] == [r["loss"] for r in recorded[:3]]
             and fresh[2]["val_loss"] == recorded[2]["val_loss"])  # after step 3's update: the weights saved
    for then in (fresh, recorded):
        if exact:
            assert [r["loss"] for r in resumed[3:]] == [r["loss"] for r in then[3:]]
            assert resumed[-1]["val_loss"] == then[-1]["val_loss"]
        else:
            assert [r["loss"] for r in resumed[3:]] == pytest.approx([r["loss"] for r in then[3:]], rel=1e-5)
            assert resumed[-1]["val_loss"] == pytest.approx(then[-1]["val_loss"], rel=1e-5)
