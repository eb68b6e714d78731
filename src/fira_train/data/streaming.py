"""C4 streamed with ``datasets``, tokenized and packed on the fly, resumable to the token.

``source="c4"`` opens ``load_dataset("allenai/c4", "en", split=..., streaming=True)``;
``source="c4:FOLDER"`` opens local files in C4's layout (``c4-train.*.json[.gz]``,
``c4-validation.*.json[.gz]``, JSON lines with a ``"text"`` field) with
``load_dataset("json", data_files=..., streaming=True)``. Everything after opening is shared.

Training stream, epoch ``e``: the train split shuffled by ``datasets`` (shard order and a
``SHUFFLE_BUFFER_DOCS``-document buffer) with seed ``epoch_seed(seed, e)`` (``seed`` itself for
epoch 0; see :func:`fira_train.data.streams.epoch_seed`); each document's ids followed
by EOS; consecutive ``cut * seq_len`` token chunks (``cut``: a run's whole step, default the
batch size) are its batches, served ``batch_size`` rows at a time as ``[batch_size, seq_len]``.
An epoch ends when the split is exhausted or ``max_train_tokens`` tokens were used in it; the
incomplete tail chunk is dropped (a batch of another size than ``cut`` runs on into the next
epoch). A state keeps ``cut`` as its ``batch_size``, and a stream that loads it takes it. The
position is (epoch, documents fully consumed in that epoch, tokens consumed of the next
document, tokens consumed in the epoch): resuming re-opens the epoch's stream, skips that many documents without tokenizing them, and drops the
consumed tokens of the partly used document, which restores the packing exactly.
"""

from __future__ import annotations

import gzip
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from fira_train.data.corpus import Corpus, digest_ids
from fira_train.data.disk_cache import fingerprint
from fira_train.data.spec import C4, C4_LOCAL_PREFIX, DataSpec
from fira_train.data.streams import (ORDER_RULE, BatchStream, check_batch_end, check_stream_args, check_stream_state,
                                     epoch_seed, order_rule)
from fira_train.data.tokenizer import build_tokenizer, encode_texts, token_dtype

logger = logging.getLogger(__name__)

C4_HUB_PATH = "allenai/c4"
C4_HUB_CONFIG = "en"
C4_SPLITS = ("train", "validation")
C4_FILE_SUFFIXES = (".json", ".json.gz", ".jsonl", ".jsonl.gz")
# Documents the shuffle buffer holds: C4 documents average ~2 kB, so this is ~20 MB of text.
SHUFFLE_BUFFER_DOCS = 10_000
# Characters of the first training documents a "bpe" tokenizer is trained on (~10k C4 documents).
BPE_SAMPLE_CHARS = 20_000_000
# Documents tokenized per call into the Rust encoder while streaming.
STREAM_CHUNK_DOCS = 64

OpenSplit = Callable[[str], Any]  # split name -> datasets.IterableDataset


def c4_data_files(folder: Path) -> dict[str, list[str]]:
    """Files of each split in a local C4-layout folder, sorted (``c4-<split>.*``)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"C4 folder {str(folder)!r} (from source 'c4:{folder}') does not exist")
    def shards(split: str, pattern: Callable[[str], Any]) -> list[Path]:
        return sorted(p for p in pattern(f"c4-{split}.*") if p.is_file() and p.name.endswith(C4_FILE_SUFFIXES))

    # The folder's own files only: the repository's root holds one folder per variant (en,
    # en.noblocklist, realnewslike, ...), which a recursive search would mix.
    files = {split: [str(p) for p in shards(split, folder.glob)] for split in C4_SPLITS}
    for split, names in files.items():
        if not names:
            variants = sorted({p.parent.relative_to(folder).as_posix() for p in shards(split, folder.rglob)})
            hint = (f"; its subfolders {', '.join(variants)} hold some: give one variant's folder, e.g. "
                    f"'c4:{folder / variants[0]}'" if variants else "")
            raise ValueError(
                f"C4 folder {str(folder)!r} holds no c4-{split}.*.json[.gz] files (C4's layout: "
                f"c4-train.00000-of-01024.json.gz, c4-validation.00000-of-00008.json.gz){hint}"
            )
    return files


def c4_opener(data_files: dict[str, list[str]] | None) -> OpenSplit:
    """``split -> IterableDataset``: the hub's C4 when ``data_files`` is None, else local JSON files."""

    def open_split(split: str) -> Any:
        import datasets  # optional: only C4 needs it, and it takes about a second to import

        if data_files is None:
            return datasets.load_dataset(C4_HUB_PATH, C4_HUB_CONFIG, split=split, streaming=True)
        try:
            return datasets.load_dataset("json", data_files={split: data_files[split]}, split=split, streaming=True)
        except Exception as exc:  # noqa: BLE001 -- datasets' own errors (an empty shard: StopIteration)
            if not _damaged_shard(exc):
                raise
            # an empty shard raises a bare StopIteration, whose text is empty
            raise ValueError(f"C4 {split} files {_named(data_files[split])} cannot be read: "
                             f"{type(exc).__name__}: {str(exc) or 'no records (an empty file?)'}") from None

    open_split.files = data_files or {}  # type: ignore[attr-defined] # named when a record cannot be read
    return open_split


def split_files(open_split: OpenSplit, split: str) -> list[str]:
    """The local files of ``split`` that ``open_split`` (:func:`c4_opener`'s) reads; [] for the hub."""
    return list(getattr(open_split, "files", {}).get(split, []))


def iter_texts(dataset: Any, split: str, files: Sequence[str] = ()) -> Iterator[str]:
    """Non-blank ``"text"`` fields of a streamed split (blank ones are skipped, as everywhere);
    ``files``, the split's local files, are named if one cannot be read."""
    rows = iter(dataset)
    named = f" (files {_named(list(files))})" if files else ""
    for number in itertools.count():
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 -- a damaged shard: gzip, JSON or arrow errors
            if not _damaged_shard(exc):
                raise
            raise ValueError(f"C4 {split} split{named}: reading the record after {number} good ones failed "
                             f"(a damaged file?): {type(exc).__name__}: {exc}") from None
        text = row.get("text") if isinstance(row, Mapping) else None
        if not isinstance(text, str):  # the files named, as for a damaged record: a split may have hundreds
            got = repr(text) if isinstance(row, Mapping) else f"a {type(row).__name__} record"
            raise ValueError(f"C4 {split} split{named}: record {number} (counted from 0 in the order read) has no "
                             f"string 'text' field (got {got[:80]})")
        if text.strip():
            yield text


def _damaged_shard(exc: Exception) -> bool:
    """Whether reading a C4 split failed on its files' contents (gzip, JSON, arrow, an empty
    shard), not on the system: an OSError (a full disk, the network, permissions) keeps
    fira-train's own message for it."""
    return not isinstance(exc, OSError) or isinstance(exc, gzip.BadGzipFile)


def _named(files: list[str]) -> str:
    return ", ".join(repr(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _file_identity(path: str) -> tuple[str, int, int]:
    # Name, size and modification time, not a content hash: a local C4 mirror is hundreds of
    # gigabytes, too much to read on every build. A changed file gets a fresh tokenizer.
    stat = os.stat(path)
    return Path(path).name, stat.st_size, stat.st_mtime_ns


def _first_chars(texts: Iterator[str], limit: int) -> list[str]:
    sample, total = [], 0
    for text in texts:
        sample.append(text)
        total += len(text)
        if total >= limit:
            break
    return sample


class StreamingBatchStream(BatchStream):
    """Training batches packed on the fly from a streamed split (see the module docstring)."""

    def __init__(
        self,
        open_train: Callable[[], Any],
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int,
        batch_size: int,
        seed: int,
        max_train_tokens: int | None = None,
        shuffle_buffer: int = SHUFFLE_BUFFER_DOCS,
        corpus: str | None = None,
        order: int = ORDER_RULE,
        files: Sequence[str] = (),
        cut: int | None = None,
    ) -> None:
        cut = check_stream_args(batch_size, seed, order, cut)
        self.corpus = corpus
        self._open_train = open_train
        self._files = tuple(files)  # the split's local files, named if one cannot be read
        self._tokenizer = tokenizer
        self._eos = tokenizer.eos_token_id
        self._dtype = token_dtype(len(tokenizer))
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        # an epoch ends where fewer than cut * seq_len tokens are left (a run's whole step): a state's
        # batch_size, which a stream that loads the state takes (see __next__)
        self.cut = cut
        self.max_train_tokens = max_train_tokens
        self.shuffle_buffer = shuffle_buffer
        self.epoch = 0
        self.documents = 0  # documents fully consumed in this epoch
        self.offset = 0  # tokens consumed of the next document
        self.tokens = 0  # tokens consumed in this epoch
        self.order = order  # epoch_seed's rule; a resumed stream keeps the rule its state was saved with
        self._close_reader()

    def _close_reader(self) -> None:
        self._texts: Iterator[str] | None = None
        self._pending: deque[np.ndarray] = deque()  # token arrays from the current position on
        self._pending_tokens = 0
        self._drop_first = 0

    def _open_reader(self) -> None:
        dataset = self._open_train()
        if self.shuffle_buffer > 1:
            dataset = dataset.shuffle(seed=epoch_seed(self.seed, self.epoch, self.order),
                                      buffer_size=self.shuffle_buffer)
        texts = iter_texts(dataset, "train", self._files)
        skipped = sum(1 for _ in itertools.islice(texts, self.documents))
        if skipped < self.documents:
            raise ValueError(
                f"cannot resume: epoch {self.epoch} of the training stream has {skipped} documents, "
                f"but the saved position is after {self.documents}"
            )
        self._texts = texts
        self._drop_first = self.offset  # the next document was partly consumed before the save

    def _read_chunk(self) -> bool:
        assert self._texts is not None
        chunk = list(itertools.islice(self._texts, STREAM_CHUNK_DOCS))
        for ids in encode_texts(self._tokenizer, chunk):
            tokens = np.asarray([*ids, self._eos], dtype=self._dtype)
            if self._drop_first:
                tokens, self._drop_first = tokens[self._drop_first :], 0
            self._pending.append(tokens)
            self._pending_tokens += len(tokens)
        return bool(chunk)

    def _take(self, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            head = self._pending[0]
            used = min(len(head), count - filled)
            out[filled : filled + used] = head[:used]
            filled += used
            if used == len(head):
                self._pending.popleft()
                self.documents, self.offset = self.documents + 1, 0
            else:
                self._pending[0] = head[used:]
                self.offset += used
        self._pending_tokens -= count
        self.tokens += count
        return out

    def _next_epoch(self, needed: int) -> None:
        if self.tokens == 0:  # a whole epoch without one batch: looping would never end
            # raised by the first batch, inside the training loop, which names no setting for it
            # (a packed corpus's error is named train.batch_size there): the keys of the config
            raise ValueError(
                f"one epoch of the training stream holds fewer than a step's train.batch_size * data.seq_len = "
                f"{self.cut} * {self.seq_len} = {needed} tokens (data.max_train_tokens="
                f"{self.max_train_tokens}); lower train.batch_size or data.seq_len, or use more data"
            )
        self.epoch, self.documents, self.offset, self.tokens = self.epoch + 1, 0, 0, 0
        self._close_reader()

    def _ready(self) -> None:
        """At the start of a batch of :attr:`cut` rows: into the next epoch unless this one holds
        a whole such batch more (within ``max_train_tokens``)."""
        needed = self.cut * self.seq_len
        while True:
            if self.max_train_tokens is not None and self.tokens + needed > self.max_train_tokens:
                self._next_epoch(needed)
                continue
            if self._texts is None:
                self._open_reader()
            while self._pending_tokens < needed and self._read_chunk():
                pass
            if self._pending_tokens < needed:
                self._next_epoch(needed)
                continue
            return

    def __next__(self) -> torch.Tensor:
        """``batch_size`` rows, in batches of :attr:`cut` rows (the state's ``batch_size``): the
        epochs end where they did for the size the stream was saved at, a batch running on into
        the next epoch where the two differ."""
        rows, parts = self.batch_size, []
        while rows:
            into = (self.tokens // self.seq_len) % self.cut  # rows of the current cut-batch taken
            if into == 0:
                self._ready()
            taken = min(rows, self.cut - into)
            parts.append(self._take(taken * self.seq_len))
            rows -= taken
        ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return torch.from_numpy(ids).view(self.batch_size, self.seq_len)  # (B, T)

    def state_dict(self) -> dict[str, int]:
        check_batch_end(type(self).__name__, self.cut, (self.tokens // self.seq_len) % self.cut, "rows")
        return {
            "epoch": self.epoch,
            "documents": self.documents,
            "offset": self.offset,
            "tokens": self.tokens,
            "seed": self.seed,
            "batch_size": self.cut,
            "seq_len": self.seq_len,
            "order": self.order,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        fixed = {"seed": self.seed, "seq_len": self.seq_len}
        rule, state = order_rule(state, type(self).__name__)
        checked = check_stream_state(state, fixed, ("epoch", "documents", "offset", "tokens", "batch_size"),
                                     type(self).__name__)
        self.cut = checked["batch_size"]  # a state of another batch size: its epochs, this size's batches
        self.epoch, self.documents = checked["epoch"], checked["documents"]
        self.offset, self.tokens = checked["offset"], checked["tokens"]
        self.order = rule
        self._close_reader()  # re-opened (and fast-forwarded) lazily by the next batch


class StreamingCorpus(Corpus):
    """C4 (or local C4-format files): streamed training split; the validation set is a fixed prefix
    of the validation split, the test set the whole documents after it."""

    def __init__(
        self,
        spec: DataSpec,
        tokenizer: PreTrainedTokenizerBase,
        tokenizer_name: str,
        val_tokens: np.ndarray,
        open_split: OpenSplit,
        shuffle_buffer: int = SHUFFLE_BUFFER_DOCS,
        test_tokens: np.ndarray | None = None,
        source_id: str | None = None,
    ) -> None:
        super().__init__(spec, tokenizer, tokenizer_name, val_tokens, test_tokens)
        self._open_split = open_split
        self.shuffle_buffer = shuffle_buffer
        # The tokenizer enters through the ids it gives the held-out text (and its EOS): not the hash
        # of its file, which a new tokenizers release writes otherwise for the same tokenizer
        self.identity = None if source_id is None else fingerprint(
            "c4-stream", source_id, tokenizer.eos_token_id, shuffle_buffer, spec.max_train_tokens,
            digest_ids(spec.seq_len, len(tokenizer), self._val_blocks, self._test_blocks))
        """A fingerprint of the files (names and sizes) or the hub dataset, the packing and the
        held-out ids (a stream's training ids are not read up front); None when not given."""

    def train_batches(self, batch_size: int, seed: int, cut: int | None = None) -> StreamingBatchStream:
        return StreamingBatchStream(
            lambda: self._open_split("train"),
            self.tokenizer,
            self.seq_len,
            batch_size,
            seed,
            max_train_tokens=self.spec.max_train_tokens,
            shuffle_buffer=self.shuffle_buffer,
            corpus=self.identity,
            order=self.spec.epoch_order,
            files=split_files(self._open_split, "train"),
            cut=cut,
        )

    def describe(self) -> dict[str, Any]:
        """As for every corpus; ``train_tokens`` is None: a stream's length is unknown up front."""
        return self._describe(None)


def _held_out_tokens(open_split: OpenSplit, tokenizer: PreTrainedTokenizerBase,
                     spec: DataSpec) -> tuple[np.ndarray, np.ndarray | None]:
    """Packed ids of the validation split's first documents, ``val_sequences * seq_len`` of them,
    and the test set's: whole documents that follow those (the document cut by the end of the
    validation set is skipped, so no document is in both), ``test_sequences * seq_len`` ids
    (``val_sequences`` when None); None with ``test_fraction=0``."""
    val_needed = spec.val_sequences * spec.seq_len
    test_needed = 0 if not spec.test_fraction else (spec.test_sequences or spec.val_sequences) * spec.seq_len
    texts = iter_texts(open_split("validation"), "validation", split_files(open_split, "validation"))
    val: list[np.ndarray] = []
    test: list[np.ndarray] = []
    val_total = test_total = 0
    dtype = token_dtype(len(tokenizer))
    while val_total < val_needed or test_total < test_needed:
        chunk = list(itertools.islice(texts, STREAM_CHUNK_DOCS))
        if not chunk:
            which = ("validation", val_total, "val", val_needed) if val_total < val_needed else (
                "test", test_total, "test", test_needed)
            raise ValueError(
                f"the validation split of {spec.source!r} holds too few tokens for the {which[0]} set: "
                f"{which[1]}, fewer than {which[2]}_sequences * seq_len = {which[3]}"
            )
        for ids in encode_texts(tokenizer, chunk):
            document = np.asarray([*ids, tokenizer.eos_token_id], dtype=dtype)
            if val_total < val_needed:
                val.append(document)
                val_total += len(document)
            elif test_total < test_needed:
                test.append(document)
                test_total += len(document)
    test_tokens = np.concatenate(test)[:test_needed] if test_needed else None
    return np.concatenate(val)[:val_needed], test_tokens


def build_c4_corpus(spec: DataSpec, cache_dir: Path, shuffle_buffer: int = SHUFFLE_BUFFER_DOCS) -> StreamingCorpus:
    """The corpus for ``source="c4"`` (hub) or ``"c4:FOLDER"`` (local files in C4's format)."""
    if spec.source == C4:
        data_files = None
        corpus_id = source_id = fingerprint("c4-hub", C4_HUB_PATH, C4_HUB_CONFIG)
    else:
        folder = Path(spec.source[len(C4_LOCAL_PREFIX) :]).expanduser()
        data_files = c4_data_files(folder)
        corpus_id = fingerprint("c4-files", [_file_identity(f) for f in data_files["train"]])
        # names and sizes, not times: a copy of the folder on another machine still resumes
        source_id = fingerprint("c4-files", [_file_identity(f)[:2] for split in C4_SPLITS for f in data_files[split]])
    open_split = c4_opener(data_files)
    tokenizer, tokenizer_name = build_tokenizer(
        spec.tokenizer,
        vocab_size=spec.vocab_size,
        corpus_id=fingerprint(corpus_id, "sample", BPE_SAMPLE_CHARS),
        training_texts=lambda: _first_chars(iter_texts(open_split("train"), "train", split_files(open_split, "train")),
                                            BPE_SAMPLE_CHARS),
        cache_dir=cache_dir,
    )
    val_tokens, test_tokens = _held_out_tokens(open_split, tokenizer, spec)
    return StreamingCorpus(spec, tokenizer, tokenizer_name, val_tokens, open_split, shuffle_buffer, test_tokens,
                           source_id=source_id)
