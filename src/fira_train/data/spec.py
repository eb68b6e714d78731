"""What to train on and how to cut it into sequences: :class:`DataSpec` (the config's ``data`` section)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fira_train.data.disk_cache import default_cache_dir
from fira_train.data.tokenizer import BPE, MIN_BPE_VOCAB_SIZE

WIKI = "wiki"
C4 = "c4"
C4_LOCAL_PREFIX = "c4:"


#: The rules by which an epoch's training order is seeded (:func:`fira_train.data.streams.epoch_seed`).
EPOCH_ORDERS = (1, 2)


def require_epoch_order(name: str, value: object) -> None:
    """ValueError naming ``name`` unless ``value`` is one of :data:`EPOCH_ORDERS` (an int: not
    True, nor 1.0)."""
    if type(value) is not int or value not in EPOCH_ORDERS:
        raise ValueError(f"{name} must be 1 (seed + epoch) or 2 (seeds drawn from (seed, epoch)), got {value!r}")


def require_int(name: str, value: object, minimum: int) -> None:
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass
class DataSpec:
    """What to train on and how to cut it into sequences."""

    source: str = WIKI
    """``"wiki"`` | ``"c4"`` | ``"c4:FOLDER"`` | a local path (file or folder of .txt / .jsonl /
    .json / .jsonl.gz, or a .npy of token ids)."""
    tokenizer: str = BPE
    """``"bpe"`` (byte-level BPE trained on the training split, cached) or a Hugging Face tokenizer
    name or local folder (e.g. ``"t5-base"``)."""
    vocab_size: int = 8192
    """Entries of the ``"bpe"`` vocabulary (256 bytes + 2 special tokens + merges); ignored otherwise."""
    seq_len: int = 256
    """Tokens per training / validation sequence."""
    val_fraction: float = 0.02
    """Fraction of documents held out for validation (fixed split, by document content), for
    sources without their own validation split; for a .npy, the fraction of tokens at its end."""
    val_sequences: int = 64
    """Number of ``seq_len`` sequences in the validation set: the first ones of the validation
    split, the same in every run."""
    test_fraction: float = 0.02
    """Fraction of documents held out for the test set, disjoint from training and validation
    (the next documents of the same content ranking; 0: no test set). For ``c4``, whose
    validation split is separate, the test set is the validation documents after the ones the
    validation set reads, and this fraction is not used; for a .npy, the fraction of tokens just
    before the validation tail. The test set is evaluated once, after the last step, and is
    never used for a choice (``fira-train sweep`` chooses on validation)."""
    test_sequences: int | None = None
    """Number of ``seq_len`` sequences in the test set; ``None``: every whole sequence of the test
    split (for ``c4``: ``val_sequences``). A number the split cannot fill is an error."""
    max_train_tokens: int | None = None
    """Cap on the training tokens, for tests and tiny runs: the first ones of the training split
    (only those documents are tokenized on a cold build); for ``c4``, the first ones of each epoch."""
    epoch_order: int = 2
    """How each epoch's training order is seeded (see :func:`fira_train.data.streams.epoch_seed`):
    ``2`` keeps the run's seed for epoch 0 and draws later epochs' seeds from (seed, epoch), so no
    two seeds share an epoch's order; ``1`` is the former ``seed + epoch`` (epoch ``e`` of seed
    ``s`` was epoch ``e - 1`` of seed ``s + 1``), to rerun results made with it as they ran. A
    resumed run keeps the rule its checkpoint's stream recorded (``1`` where none is recorded)."""
    cache_dir: str | None = None
    """Where tokenizers and tokenized corpora are cached; default ``$FIRA_CACHE`` or
    ``~/.cache/fira-train``."""

    def __post_init__(self) -> None:
        if isinstance(self.source, os.PathLike):
            self.source = os.fspath(self.source)
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"data.source must be 'wiki', 'c4', 'c4:FOLDER' or a path, got {self.source!r}")
        if self.source.startswith(C4_LOCAL_PREFIX) and not self.source[len(C4_LOCAL_PREFIX):].strip():
            raise ValueError(f"data.source {self.source!r} names no folder after 'c4:'")
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        if not isinstance(self.tokenizer, str) or not self.tokenizer.strip():
            raise ValueError(f"data.tokenizer must be 'bpe' or a Hugging Face name/path, got {self.tokenizer!r}")
        require_int("data.vocab_size", self.vocab_size, MIN_BPE_VOCAB_SIZE if self.tokenizer == BPE else 1)
        require_int("data.seq_len", self.seq_len, 2)  # one token has no next token to predict
        if (
            isinstance(self.val_fraction, bool)
            or not isinstance(self.val_fraction, (int, float))
            or not 0.0 < self.val_fraction < 1.0
        ):
            raise ValueError(f"data.val_fraction must be a float in (0, 1), got {self.val_fraction!r}")
        require_int("data.val_sequences", self.val_sequences, 1)
        if (
            isinstance(self.test_fraction, bool)
            or not isinstance(self.test_fraction, (int, float))
            or not 0.0 <= self.test_fraction < 1.0
            or self.val_fraction + self.test_fraction >= 1.0
        ):
            raise ValueError(f"data.test_fraction must be a float in [0, 1 - val_fraction), got {self.test_fraction!r} "
                             f"(data.val_fraction={self.val_fraction!r})")
        if self.test_sequences is not None:
            require_int("data.test_sequences", self.test_sequences, 1)
            if self.test_fraction == 0:
                raise ValueError(f"data.test_sequences={self.test_sequences} asks for a test set, but "
                                 "data.test_fraction=0 holds none out")
        if self.max_train_tokens is not None:
            require_int("data.max_train_tokens", self.max_train_tokens, 1)
        require_epoch_order("data.epoch_order", self.epoch_order)
        if isinstance(self.cache_dir, os.PathLike):
            self.cache_dir = os.fspath(self.cache_dir)
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir.strip()):
            raise ValueError(f"data.cache_dir must be None or a folder path, got {self.cache_dir!r}")

    def resolved_cache_dir(self) -> Path:
        """``cache_dir``, or the default (``$FIRA_CACHE`` or ``~/.cache/fira-train``)."""
        return Path(self.cache_dir).expanduser() if self.cache_dir is not None else default_cache_dir()


