"""The Trainer's checkpoint folders of a fine-tuning run, read without torch (:mod:`fira_train.finetune.checkpoints`)."""

from __future__ import annotations

from pathlib import Path

from fira_train.finetune.checkpoints import has_checkpoint


def test_a_checkpoint_counts_as_the_resume_counts_it(tmp_path: Path) -> None:
    """After a stop, the messages said checkpoints were kept where the resume would remove them (a
    trainer_state.json cut short, or of another step): one rule, the resume's, for both."""
    folder = tmp_path / "trainer"
    assert not has_checkpoint(folder)  # no folder yet
    cut = folder / "checkpoint-4"
    cut.mkdir(parents=True)
    (cut / "trainer_state.json").write_text('{"global_step": 4')
    other = folder / "checkpoint-6"
    other.mkdir()
    (other / "trainer_state.json").write_text('{"global_step": 2}')
    (folder / "checkpoint-final").mkdir()  # not a step
    assert not has_checkpoint(folder)
    (cut / "trainer_state.json").write_text('{"global_step": 4}')
    assert has_checkpoint(folder)
