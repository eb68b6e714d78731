"""The fine-tuning run's Trainer folder (:mod:`fira_train.finetune.train`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from fira_train.finetune.train import SITTINGS_FILE, remove_checkpoints


def test_removing_the_checkpoints_leaves_files_the_run_did_not_write(tmp_path: Path) -> None:
    """Once the results were written, OUT/trainer was deleted whole: ``--out .`` in a project with
    a trainer/ folder of its own (a Python package of that name) lost it. Now only the Trainer's
    checkpoint-<step> folders and the run's own records go, and the folder if nothing else is left."""
    folder = tmp_path / "trainer"
    (folder / "checkpoint-2").mkdir(parents=True)
    (folder / "checkpoint-2" / "optimizer.pt").write_bytes(b"state")
    for name in ("run_settings.json", SITTINGS_FILE):
        (folder / name).write_text("{}")
    (folder / "__init__.py").write_text("# the user's package\n")
    (folder / "checkpoint-final").mkdir()  # not a step: not the Trainer's
    remove_checkpoints(SimpleNamespace(out_dir=tmp_path))
    assert sorted(p.name for p in folder.iterdir()) == ["__init__.py", "checkpoint-final"]
    (folder / "__init__.py").unlink()
    (folder / "checkpoint-final").rmdir()
    (folder / "checkpoint-4").mkdir()
    remove_checkpoints(SimpleNamespace(out_dir=tmp_path))
    assert not folder.exists()
