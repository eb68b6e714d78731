"""Which entries of a run directory are a run's: another tool's checkpoints/ is not one."""

from __future__ import annotations

from pathlib import Path

import pytest

from fira_train.run import run_files
from fira_train.run.run_dir import prepare_out_dir
from fira_train.run.train import train
from tests.fira_train.harness_fixtures import micro_config


def _their_checkpoints(out: Path) -> Path:
    theirs = out / "checkpoints" / "epoch=3.ckpt"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"weights of another tool")
    return theirs


def test_a_checkpoints_folder_of_another_tools_files_alone_is_no_run_to_resume(tmp_path: Path) -> None:
    """It counted as a run (previous_run named checkpoints/), so --resume was accepted: the run
    said it found no checkpoint, trained from step 0 and wrote its checkpoints among the other
    tool's files. Now the resume is refused, naming the folder and what is in it."""
    config = micro_config(tmp_path, "optim.method=adamw", "train.steps=2", "train.save_every=1",
                          "train.eval_every=0")
    out = tmp_path / "run"
    theirs = _their_checkpoints(out)
    assert run_files.previous_run(out) == []
    for resume in ("latest", 1):
        with pytest.raises(FileExistsError, match=r"'[^']*run' holds files that fira-train did not write "
                                                  r"\(checkpoints/epoch=3.ckpt\)"):
            train(config, resume=resume)
    assert sorted(p.name for p in out.rglob("*")) == ["checkpoints", "epoch=3.ckpt"]
    prepare_out_dir(config, out, None, overwrite=True)  # a new run there: beside them, never over them
    assert theirs.read_bytes() == b"weights of another tool"


def test_a_checkpoints_folder_with_a_runs_checkpoint_is_a_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _their_checkpoints(out)
    (out / "checkpoints" / ".tmp-step_00000002-77").mkdir()  # a first save, killed part-way
    assert run_files.previous_run(out) == ["checkpoints"]
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run_files.previous_run(out) == ["metrics.jsonl", "checkpoints"]
