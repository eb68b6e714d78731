"""Corpora: a tokenizer, training batch streams, a fixed validation set and a held-out test set
(:class:`Corpus`), and :class:`PackedCorpus`, whose training tokens fit in memory (or a
memory-mapped cache file)."""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from fira_train.data.disk_cache import fingerprint
from fira_train.data.spec import DataSpec, require_int
from fira_train.data.streams import BatchStream, PackedBatchStream
from fira_train.data.tokenizer import token_dtype
from fira_train.files import read_regular_text, write_text_atomic


def test_blocks(spec: DataSpec, test_tokens: np.ndarray | None) -> np.ndarray:
    """The test set as ``(sequences, seq_len)`` blocks: ``spec.test_sequences`` of them, or every
    whole sequence of ``test_tokens`` when that is None (zero rows when there is no test split)."""
    seq_len = spec.seq_len
    available = 0 if test_tokens is None else len(test_tokens) // seq_len
    wanted = available if spec.test_sequences is None else spec.test_sequences
    if wanted > available:
        raise ValueError(
            f"the test split of {spec.source!r} (test_fraction={spec.test_fraction}) holds "
            f"{0 if test_tokens is None else len(test_tokens)} tokens, fewer than test_sequences * seq_len "
            f"= {spec.test_sequences} * {seq_len}; raise test_fraction or lower test_sequences / seq_len"
        )
    if wanted == 0 and spec.test_fraction > 0:
        raise ValueError(
            f"the test split of {spec.source!r} (test_fraction={spec.test_fraction}) holds "
            f"{0 if test_tokens is None else len(test_tokens)} tokens, not one sequence of seq_len={seq_len}: "
            "raise test_fraction, or set it to 0 for no test set")
    if wanted == 0:
        return np.zeros((0, seq_len), dtype=np.int64)
    assert test_tokens is not None
    return np.asarray(test_tokens[: wanted * seq_len], dtype=np.int64).reshape(wanted, seq_len)


#: What a run's record of its data (``Corpus.describe()``) is compared by where it has neither a
#: token digest nor a fingerprint (written before runs recorded one).
DATA_IDENTITY = ("tokenizer", "vocab_size", "seq_len", "train_tokens", "val_tokens", "test_tokens")
#: Ids hashed per chunk by :func:`digest_ids` (bounds the memory of a cast to the canonical dtype).
DIGEST_CHUNK = 1 << 24


def digest_ids(seq_len: int, vocab_size: int, *parts: np.ndarray) -> str:
    """A sha256 of the token ids ``parts`` (train, validation, test), each in the smallest dtype
    that holds ``vocab_size`` ids, with the parts' lengths, ``seq_len`` and ``vocab_size`` (the
    rows of the model's embedding): equal exactly when a run would see the same ids in the same
    blocks with the same vocabulary, whatever the text, tokenizer file or cache they came from.
    One pass over the ids, a chunk at a time."""
    dtype = token_dtype(vocab_size)
    digest = hashlib.sha256(repr((seq_len, vocab_size, dtype.str, [int(np.size(p)) for p in parts])).encode())
    for part in parts:
        flat = np.asarray(part).reshape(-1)
        for start in range(0, flat.size, DIGEST_CHUNK):  # a memory-mapped corpus is read a chunk at a time
            digest.update(np.ascontiguousarray(flat[start : start + DIGEST_CHUNK], dtype=dtype).tobytes())
    return digest.hexdigest()[:32]


def data_change(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """Why a run's record of its data (``saved``: a ``describe()``, or a part of it) differs from
    what the corpus says of itself now, with the values that differ, e.g. ``"its text, split or
    tokenizer changed since: token_digest='...' (now '...')"``; None where they agree or nothing
    can be compared.

    The most exact record both sides have decides: the digest of the token ids
    (``token_digest``), else the fingerprint of text, split, tokenizer file and packing (``corpus``:
    records written before token digests; a ``tokenizers`` release that writes the same
    tokenizer's file otherwise changes it too), else the :data:`DATA_IDENTITY` keys both record
    (the tokenizer's name among them, which a new version of the BPE recipe changes).
    """
    if saved.get("token_digest") and now.get("token_digest"):
        keys = ["token_digest"]
    elif saved.get("corpus") and now.get("corpus"):
        keys = ["corpus"]
    else:
        keys = [k for k in DATA_IDENTITY if saved.get(k) is not None and now.get(k) is not None]
    differ = [k for k in keys if saved[k] != now[k]]
    if not differ:
        return None
    cause = "its text, split or tokenizer changed since"
    if set(differ) <= {"corpus", "tokenizer"}:
        # a record without a token digest cannot tell a new tokenizer from the same one written
        # or named otherwise (a tokenizers release, a new version of the BPE recipe that cuts nothing)
        cause += " (or only the tokenizer's file or name did: a record from before token digests cannot tell)"
    return f"{cause}: " + ", ".join(f"{k}={saved[k]!r} (now {now[k]!r})" for k in differ)


class Corpus(ABC):
    """A tokenized corpus: a tokenizer, training batch streams, a fixed validation set and a
    held-out test set (possibly empty: ``test_batches`` is then ``[]``)."""

    def __init__(
        self, spec: DataSpec, tokenizer: PreTrainedTokenizerBase, tokenizer_name: str, val_tokens: np.ndarray,
        test_tokens: np.ndarray | None = None,
    ) -> None:
        needed = spec.val_sequences * spec.seq_len
        if len(val_tokens) < needed:
            raise ValueError(f"validation tokens: need {needed}, got {len(val_tokens)}")
        self.spec = spec
        self.tokenizer = tokenizer
        self.tokenizer_name = tokenizer_name
        self._val_blocks = np.asarray(val_tokens[:needed], dtype=np.int64).reshape(spec.val_sequences, spec.seq_len)
        self._test_blocks = test_blocks(spec, test_tokens)

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``: the rows the model's embedding must hold (may be below ``spec.vocab_size``)."""
        return len(self.tokenizer)

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @abstractmethod
    def train_batches(self, batch_size: int, seed: int, cut: int | None = None) -> BatchStream:
        """A fresh training stream of ``batch_size`` sequences a batch, its epochs cut in batches of
        ``cut`` (default ``batch_size``: a run's whole step), positioned at its start (load a state
        to resume)."""

    def val_batches(self, batch_size: int) -> list[torch.Tensor]:
        """The fixed validation set, ``val_sequences`` sequences in ``LongTensor[B, seq_len]`` batches.

        The sequences and their order do not depend on any seed; only the last batch can be
        smaller than ``batch_size`` (when it does not divide ``val_sequences``).
        """
        require_int("batch_size", batch_size, 1)
        blocks = torch.from_numpy(self._val_blocks.copy())
        return list(blocks.split(batch_size))

    def test_batches(self, batch_size: int) -> list[torch.Tensor]:
        """The held-out test set in ``LongTensor[B, seq_len]`` batches, as ``val_batches``; ``[]``
        without a test split. Evaluate it once, after training: it is never used for a choice."""
        require_int("batch_size", batch_size, 1)
        if not len(self._test_blocks):
            return []
        return list(torch.from_numpy(self._test_blocks.copy()).split(batch_size))

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """``{"source", "train_tokens", "val_tokens", "test_tokens", "tokenizer", "vocab_size",
        "seq_len", "corpus", "token_digest"}``; ``corpus``: the fingerprint of the text, split, tokenizer
        and packing, ``token_digest``: the :func:`digest_ids` of the ids it serves (each None where it
        is not computed: a streamed corpus). :func:`data_change` compares two of these."""

    def _describe(self, train_tokens: int | None) -> dict[str, Any]:
        return {
            "source": self.spec.source,
            "train_tokens": train_tokens,
            "val_tokens": int(self._val_blocks.size),
            "test_tokens": int(self._test_blocks.size),
            "tokenizer": self.tokenizer_name,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "corpus": getattr(self, "identity", None),
            "token_digest": getattr(self, "token_digest", None),
        }


class PackedCorpus(Corpus):
    """A corpus whose training tokens fit in memory (or a memory-mapped cache file)."""

    def __init__(
        self,
        spec: DataSpec,
        tokenizer: PreTrainedTokenizerBase,
        tokenizer_name: str,
        train_tokens: np.ndarray,
        val_tokens: np.ndarray,
        test_tokens: np.ndarray | None = None,
        identity: str | None = None,
        digest_dir: Path | None = None,
        digest_key: str | None = None,
    ) -> None:
        super().__init__(spec, tokenizer, tokenizer_name, val_tokens, test_tokens)
        self.identity = identity
        """A fingerprint of the text, split, tokenizer and packing (None: not computed)."""
        self._digest_dir = digest_dir
        self._digest_key = digest_key
        if spec.max_train_tokens is not None:
            train_tokens = train_tokens[: spec.max_train_tokens]
        if len(train_tokens) < spec.seq_len:
            raise ValueError(
                f"the training split of {spec.source!r} holds {len(train_tokens)} tokens{self._capped()}, fewer "
                f"than seq_len={spec.seq_len}"
            )
        self.train_tokens = train_tokens

    def _capped(self) -> str:
        cap = self.spec.max_train_tokens
        return "" if cap is None else f" (capped by data.max_train_tokens={cap})"

    def train_batches(self, batch_size: int, seed: int, cut: int | None = None) -> PackedBatchStream:
        try:
            return PackedBatchStream(self.train_tokens, self.seq_len, batch_size, seed, corpus=self.identity,
                                     token_digest=self.token_digest, order=self.spec.epoch_order, cut=cut)
        except ValueError as err:  # too few sequences for a batch: say what capped them
            raise ValueError(f"{err}{self._capped()}") from None

    @cached_property
    def token_digest(self) -> str:
        """The :func:`digest_ids` of the training tokens its blocks use, and of the validation
        and test blocks (one pass over the ids, on first use). With a ``digest_dir`` (a corpus
        from the token cache, whose files were checked against their SHA-256 as they loaded) the
        digest is kept there, keyed by the corpus's identity and everything else it hashes, so a
        later start reads no id a second time (a large corpus took seconds per start and rank).
        ``digest_key`` (the token cache entry's file hashes) keys it too: an entry built again under
        the same identity with other ids (encoded otherwise) is not given the digest of the former."""
        used = len(self.train_tokens) // self.seq_len * self.seq_len
        path = None
        if self._digest_dir is not None and self.identity is not None:
            salt = () if self._digest_key is None else (self._digest_key,)
            name = fingerprint(self.identity, self.seq_len, used, self.vocab_size, self._val_blocks.shape,
                               self._test_blocks.shape, *salt)
            path = self._digest_dir / f"{name}.txt"
            try:
                kept = read_regular_text(path).strip()
                if re.fullmatch(r"[0-9a-f]{32}", kept):  # else cut short (a start killed writing it): again
                    return kept
            except (OSError, ValueError):  # not UTF-8, too large, not a file: computed again
                pass
        digest = digest_ids(self.seq_len, self.vocab_size, self.train_tokens[:used], self._val_blocks,
                            self._test_blocks)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(path, digest + "\n")
            except OSError:  # a cache that cannot be written: computed again next time
                pass
        return digest

    def describe(self) -> dict[str, Any]:
        return self._describe(len(self.train_tokens) // self.seq_len * self.seq_len)
