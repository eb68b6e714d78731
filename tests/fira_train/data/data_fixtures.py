"""Shared helpers of the data tests: pseudo-English documents, JSON-lines files, small specs."""

from __future__ import annotations

import errno
import gzip
import json
import os
import random
from pathlib import Path

import numpy as np
import torch

from fira_train.data.spec import DataSpec
from fira_train.data.streams import BatchStream

WORDS = (
    "the of and a to in is was for on that with as by at from his her an were are which this be "
    "river mountain empire language science music planet animal war city king queen theory"
).split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Distinct pseudo-English documents (each starts with a unique marker)."""
    rng = random.Random(seed)
    return [f"Doc{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) + "." for i in range(n)]


def write_jsonl(path: Path, docs: list[str], **extra: str) -> Path:
    lines = [json.dumps({"text": d, **extra}) for d in docs]
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


def spec_for(source: Path | str, cache: Path, **overrides: object) -> DataSpec:
    options = dict(source=str(source), vocab_size=300, seq_len=16, val_fraction=0.2, val_sequences=4,
                   cache_dir=str(cache))
    options.update(overrides)
    return DataSpec(**options)  # type: ignore[arg-type]


def take(stream: BatchStream, n: int) -> list[torch.Tensor]:
    return [next(stream) for _ in range(n)]


def split_on_eos(tokens: np.ndarray, tokenizer: object) -> list[str]:
    """Decode a packed stream back into its documents."""
    eos = tokenizer.eos_token_id  # type: ignore[attr-defined]
    docs, current = [], []
    for t in tokens.tolist():
        if t == eos:
            docs.append(tokenizer.decode(current))  # type: ignore[attr-defined]
            current = []
        else:
            current.append(t)
    return docs


def read_only(monkeypatch, folder: Path) -> None:
    """Making a folder under ``folder`` fails as on a read-only mount (chmod does not stop root)."""
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        target = Path(os.path.abspath(path))
        if target == folder or folder in target.parents:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
