"""The Trainer's checkpoints of a fine-tuning run (``OUT/trainer/checkpoint-<step>``), read
without torch or transformers: the run's resume (:func:`fira_train.finetune.train.resume_point`)
and the command line's messages after a stop (:func:`has_checkpoint`) tell them apart alike."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fira_train.files import parse_json, read_regular_text

if TYPE_CHECKING:  # annotations only
    from fira_train.finetune.config import FinetuneConfig


def checkpoint_dir(config: "FinetuneConfig") -> Path:
    """Where the Trainer's checkpoints of this run go (``checkpoint-<step>`` folders)."""
    return config.out_dir / "trainer"


def checkpoint_step(checkpoint: str | Path) -> int:
    """The step of a Trainer checkpoint folder (``checkpoint-<step>``)."""
    return int(Path(checkpoint).name.rsplit("-", 1)[1])


def checkpoint_folders(folder: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the Trainer's ``checkpoint-<step>`` folders in ``folder``, by step."""
    return sorted((checkpoint_step(p), p) for p in folder.glob("checkpoint-*")
                  if p.is_dir() and p.name.rsplit("-", 1)[1].isdigit())


def incomplete(checkpoint: Path, step: int) -> str | None:
    """Why the Trainer checkpoint ``checkpoint`` of ``step`` is incomplete, or None."""
    state = checkpoint / "trainer_state.json"
    try:
        # a FIFO or a device there (ValueError: not a file) is raised, as another OSError (EIO,
        # EACCES) is: the Trainer writes no such thing, and a good checkpoint is not removed for it
        text = read_regular_text(state)
    except FileNotFoundError:
        return "it has no trainer_state.json"
    except UnicodeDecodeError as err:  # not text
        return f"its trainer_state.json does not parse: {err}"
    try:
        saved = parse_json(text)
    except ValueError as err:  # not JSON (cut short)
        return f"its trainer_state.json does not parse: {err}"
    recorded = saved.get("global_step") if isinstance(saved, dict) else None
    return None if recorded == step else f"its trainer_state.json records global_step={recorded!r}"


def has_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a complete checkpoint (:func:`incomplete`), which the same command
    continues from; one that cannot be read counts (the resume raises its error, removing nothing)."""
    for step, path in checkpoint_folders(folder):
        try:
            if incomplete(path, step) is None:
                return True
        except (OSError, ValueError):
            return True
    return False
