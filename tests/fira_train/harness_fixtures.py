"""Shared helpers of the harness tests: a tiny local corpus and micro-recipe configs."""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Callable
from pathlib import Path


from fira_train.config.overrides import apply_overrides
from fira_train.config.recipes import micro
from fira_train.config.run_config import RunConfig
from fira_train.run.callbacks import TrainCallback

SUBJECTS = ["the cat", "a dog", "the old bird", "my friend", "the teacher", "a small child", "the king"]
VERBS = ["sees", "likes", "finds", "follows", "helps", "watches", "paints"]
OBJECTS = ["the red ball", "a tall tree", "the house", "the river", "a book", "the garden", "a song"]


def write_corpus(directory: Path, documents: int = 300, seed: int = 0) -> Path:
    """A folder with one .txt file of ``documents`` paragraphs of simple, learnable sentences."""
    rng = random.Random(seed)
    paragraphs = []
    for _ in range(documents):
        sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                     for _ in range(rng.randint(4, 9))]
        paragraphs.append(" ".join(s.capitalize() for s in sentences))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "corpus.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return directory


def micro_config(root: Path, *overrides: str, out: str = "run") -> RunConfig:
    """The micro recipe on ``root/corpus`` (written if missing), a 300-entry BPE, one CPU thread."""
    corpus = root / "corpus"
    if not corpus.exists():
        write_corpus(corpus)
    return apply_overrides(micro(), [
        f"data.source={corpus}", f"data.cache_dir={root / 'cache'}", "data.vocab_size=300",
        "data.val_fraction=0.1", f"train.out_dir={root / out}", "train.progress=false",
        "train.tensorboard=false", "train.num_threads=1", *overrides,
    ])



class StopRun(Exception):
    """The kill that :func:`stop_at_checkpoint` simulates."""


class StopBefore(TrainCallback):
    """Raises :class:`StopRun` at step ``step`` before its update: the run dies after its previous
    checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def before_step(self, step, model, optimizer, loss) -> None:
        if step == self.step:
            raise StopRun


def stop_at_checkpoint(monkeypatch, step: int, *, saved: bool, once_per_run: bool = False) -> Callable[[], None]:
    """Make one-process runs stop (raise :class:`StopRun`) at the checkpoint of ``step``: right
    after writing it (``saved``) or before (the steps since the previous checkpoint are lost);
    ``once_per_run``: only the first time each run folder reaches it. Returns what takes it back
    (the other patches of ``monkeypatch`` stay)."""
    from fira_train.run import checkpoint as ckpt

    real_save, stopped = ckpt.save_checkpoint, set()

    def save(run_dir, at, state):
        stop = at == step and not (once_per_run and run_dir in stopped)
        if stop:
            stopped.add(run_dir)
            if not saved:
                raise StopRun
        path = real_save(run_dir, at, state)
        if stop:
            raise StopRun
        return path

    monkeypatch.setattr(ckpt, "save_checkpoint", save)
    return lambda: monkeypatch.setattr(ckpt, "save_checkpoint", real_save)


def full_disk_at(name: str, real_save):
    """A ``torch.save`` that, writing into a folder named ``name``, writes part of the file and then
    finds the disk full (as a real full disk does: some bytes land first)."""
    def save(obj, f, *args, **kwargs):
        if name not in str(getattr(f, "name", f)):
            return real_save(obj, f, *args, **kwargs)
        f.write(b"PK\x03\x04 part of a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(f, "name", None))

    return save
