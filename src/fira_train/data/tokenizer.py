"""Tokenizers for pre-training: a cached byte-level BPE trained on the corpus, or a Hugging Face one.

``"bpe"`` trains a GPT-2 style byte-level BPE with the ``tokenizers`` library on the training
split: every byte is in the base alphabet (so any text round-trips, nothing is ever unknown),
and ``vocab_size - 258`` merges are learned on top of the 256 bytes and two special tokens,
``<|endoftext|>`` (EOS, also used as BOS) and ``<|pad|>``. The result is wrapped as a
``transformers.PreTrainedTokenizerFast`` and cached on disk under a hash of (corpus identity,
vocab size, recipe version, ``tokenizers`` version), so later builds load it in milliseconds
and get the identical vocabulary.

Any other name is passed to ``transformers.AutoTokenizer.from_pretrained`` (a hub name such as
``"t5-base"`` when online, or a local folder holding ``tokenizer.json`` / ``tokenizer_config.json``).
"""

from __future__ import annotations

import json
import logging
import re
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from fira_train.data.disk_cache import (
    TOKENIZERS,
    atomic_directory,
    check_digests,
    file_digests,
    fingerprint,
    require_writable,
)
from fira_train.files import parse_json, read_regular_text

logger = logging.getLogger(__name__)

BPE = "bpe"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
BYTE_ALPHABET_SIZE = 256
MIN_BPE_VOCAB_SIZE = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
# Bump when the training recipe changes, so old cache entries are not mistaken for new ones.
# 2: runs of more than LONGEST_WORD characters without whitespace are cut for training.
BPE_RECIPE_VERSION = 2
#: The longest run without whitespace the BPE trainer sees whole. The trainer's time grows faster
#: than a pre-token's length (``benchmarks/bpe_long_runs.py``, 300 short documents and one run of
#: random letters, 2000 entries, 2026-11-28 on the 2-core CPU: 4.7 s whole and 0.4 s cut into
#: 256-character pieces at 100k letters, 103.5 s and 0.9 s at 400k), and a merge across a cut of
#: such a run is never worth a vocabulary entry. Only training is affected: encoding reads every
#: text whole.
LONGEST_WORD = 256
_LONG_RUN = re.compile(r"\S{%d,}" % (LONGEST_WORD + 1))


def _cut_long_runs(text: str) -> str:
    return _LONG_RUN.sub(lambda run: " ".join(run[0][i : i + LONGEST_WORD]
                                              for i in range(0, len(run[0]), LONGEST_WORD)), text)
# Documents per call into the Rust encoder: large enough to use its threads, small enough
# that the per-document Python lists stay small.
ENCODE_CHUNK_DOCS = 1024


def train_bpe(texts: Iterable[str], vocab_size: int, *, length: int | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with ``vocab_size`` entries (bytes + specials + merges) on ``texts``.

    The vocabulary can come out smaller than ``vocab_size`` when the texts admit fewer merges
    (a tiny corpus); ``len(tokenizer)`` is the size the model's embedding must hold.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_BPE_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an int >= {MIN_BPE_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} "
            f"special tokens) for a byte-level BPE, got {vocab_size!r}"
        )
    backend = Tokenizer(models.BPE())
    # GPT-2's pre-tokenizer: split on its regex (words, numbers, punctuation, spaces), then map
    # bytes to printable characters. No prefix space, so decode(encode(text)) == text exactly.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator((_cut_long_runs(text) for text in texts), trainer=trainer, length=length)
    return wrap_bpe(backend)


def wrap_bpe(backend: Any) -> PreTrainedTokenizerFast:
    """Wrap a ``tokenizers.Tokenizer`` holding our special tokens as a Hugging Face tokenizer."""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )


def bpe_cache_key(corpus_id: str, vocab_size: int) -> str:
    """Cache key of a BPE trained on the corpus identified by ``corpus_id``."""
    return f"bpe{vocab_size}-" + fingerprint("bpe", corpus_id, vocab_size, BPE_RECIPE_VERSION, tokenizers.__version__)


def load_or_train_bpe(
    corpus_id: str,
    training_texts: Callable[[], Sequence[str]],
    vocab_size: int,
    cache_dir: str | Path,
) -> tuple[PreTrainedTokenizerFast, str]:
    """Return ``(tokenizer, cache_key)``: the cached BPE for ``corpus_id`` or a freshly trained one.

    ``training_texts`` is called only on a cache miss (reading the corpus is the slow part of a
    warm build). The trained tokenizer is saved atomically, so a killed build leaves no entry.
    """
    key = bpe_cache_key(corpus_id, vocab_size)
    entry = Path(cache_dir) / TOKENIZERS / key
    if entry.is_dir():
        try:
            _check_entry_digests(entry)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(entry))
            if tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN:
                return tokenizer, key
        except Exception as exc:  # noqa: BLE001 -- a damaged entry (tokenizers raises bare Exceptions): rebuild
            logger.warning("cached tokenizer %s is unreadable (%s); training it again", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
    require_writable(entry.parent)  # before the corpus is read and the tokenizer trained for it
    texts = training_texts()
    logger.info("training a %d-entry byte-level BPE on %d documents", vocab_size, len(texts))
    tokenizer = train_bpe(texts, vocab_size, length=len(texts))
    with atomic_directory(entry) as temp:
        tokenizer.save_pretrained(str(temp))
        _write_entry_digests(temp)
    return tokenizer, key


#: The file of a BPE cache entry that records the SHA-256 of the entry's other files.
TOKENIZER_DIGESTS = "sha256.json"


def _entry_files(entry: Path) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in entry.iterdir() if p.is_file() and p.name != TOKENIZER_DIGESTS))


def _write_entry_digests(entry: Path) -> None:
    (entry / TOKENIZER_DIGESTS).write_text(json.dumps(file_digests(entry, _entry_files(entry)), indent=1))


def _check_entry_digests(entry: Path) -> None:
    """ValueError if a file of the BPE cache entry ``entry`` is not as it was written (an edited or
    damaged ``tokenizer.json`` that still parses would give every later run another vocabulary,
    silently), or if the entry lacks one it recorded, or holds one it did not. An entry written
    before the record existed is read as before, unchecked (adding a record to it here could race
    with another process reading it; a token cache built from it is checked by its own digests)."""
    record = entry / TOKENIZER_DIGESTS
    if not record.is_file():
        return
    recorded = parse_json(read_regular_text(record))  # capped: a record of a few hashes
    if not isinstance(recorded, dict) or sorted(recorded) != list(_entry_files(entry)):
        raise ValueError(f"its files are not those recorded in {TOKENIZER_DIGESTS}")
    check_digests(entry, recorded, tuple(recorded))


def load_pretrained_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(name)`` with EOS checked and PAD defaulting to EOS.

    Raises:
        OSError: the tokenizer cannot be loaded (offline and not a local folder, or a typo);
            the message names it and suggests the override ``data.tokenizer=bpe``.
        ValueError: the tokenizer has no EOS (or SEP) token to separate packed documents.
    """
    hint = "pass data.tokenizer=bpe to train a byte-level BPE on the corpus"
    looks_like_path = os.path.isabs(name) or name.startswith((".", "~"))
    if looks_like_path and not Path(name).expanduser().is_dir():
        what = "is a file, not a folder" if Path(name).expanduser().exists() else "does not exist"
        raise OSError(f"tokenizer folder {name!r} {what}; pass the folder holding tokenizer.json "
                      f"(tokenizer_config.json beside it), or {hint}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(Path(name).expanduser()) if looks_like_path else name,
                                                  trust_remote_code=False)
    except Exception as exc:  # hub/network/validation errors come in many types; all mean "cannot load"
        raise OSError(
            f"could not load tokenizer {name!r} ({type(exc).__name__}: {exc}). Hub names need the "
            f"internet (set HF_HUB_OFFLINE=1 to fail fast without it); offline, pass a local folder "
            f"holding tokenizer.json, or {hint}."
        ) from exc
    if tokenizer.eos_token_id is None:
        if tokenizer.sep_token_id is None:
            raise ValueError(
                f"tokenizer {name!r} has neither an EOS nor a SEP token to separate packed documents"
            )
        tokenizer.eos_token = tokenizer.sep_token  # BERT-style vocabularies end sequences with [SEP]
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # GPT-2 convention: packed data never pads anyway
    # before tokenizer_fingerprint: the cache key is that of the tokenizer that encodes the corpus
    disable_truncation_and_padding(tokenizer)
    return tokenizer


def disable_truncation_and_padding(tokenizer: PreTrainedTokenizerBase) -> None:
    """Turn off the truncation and padding a fast tokenizer's ``tokenizer.json`` may carry.

    ``transformers`` enables both on the backend from the file (some hub tokenizers ship
    ``"truncation": {"max_length": 512, ...}`` or a ``"padding"`` strategy) and turns them off only
    inside its own ``__call__``. :func:`encode_texts` calls the backend directly, so without this
    every document beyond ``max_length`` tokens lost its tail, and every shorter one was padded
    with pad ids, in the training stream and the held-out sets alike, silently.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its __call__ pads and truncates only when asked to
        return
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash that changes whenever the mapping text -> ids could change."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body: object = backend.to_str()
    else:  # a slow (pure Python) tokenizer: its vocabulary is the best available identity
        body = sorted(tokenizer.get_vocab().items())
    return fingerprint(type(tokenizer).__name__, body, tokenizer.eos_token_id, len(tokenizer))


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds ids ``< vocab_size`` (uint16 halves the cache for <= 65,536)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, whole: without special tokens (no BOS/EOS added by the tokenizer),
    truncation or padding (see :func:`disable_truncation_and_padding`), and with the text of a
    special token encoded as text: a web page that writes ``<|endoftext|>`` (C4 has such pages)
    got the EOS id in the middle of the document, a false document end, and ``<|pad|>`` the pad
    id. Texts that hold no special token's text encode as before."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True)["input_ids"])
    # A tokenizer not loaded here may truncate or pad on the backend: both are turned off for the
    # encoding and put back after it, as transformers' own __call__ does, so the caller's
    # tokenizer behaves afterwards as it did before.
    truncation, padding, as_text = backend.truncation, backend.padding, backend.encode_special_tokens
    disable_truncation_and_padding(tokenizer)
    backend.encode_special_tokens = True
    # encode_batch_fast skips the offsets bookkeeping we do not need (tokenizers >= 0.21).
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    try:
        return [encoding.ids for encoding in encode(list(texts), add_special_tokens=False)]
    finally:
        backend.encode_special_tokens = as_text
        if truncation is not None:
            backend.enable_truncation(**truncation)
        if padding is not None:
            backend.enable_padding(**padding)


def encode_documents(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_tokens: int | None = None
) -> np.ndarray:
    """The packed token stream ``ids(doc_0) EOS ids(doc_1) EOS ...`` as a 1-D array.

    Every document, the last included, is followed by ``tokenizer.eos_token_id``, so a model
    learns where documents end and no block mixes two documents without a separator. With
    ``max_tokens``, only the first ``max_tokens`` tokens of that stream are returned, and
    encoding stops once they are known (documents after them are never tokenized).
    """
    pieces = list(iter_encoded_documents(tokenizer, texts, max_tokens))
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=token_dtype(len(tokenizer)))


def iter_encoded_documents(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_tokens: int | None = None
) -> Iterator[np.ndarray]:
    """:func:`encode_documents`'s stream, a chunk of :data:`ENCODE_CHUNK_DOCS` documents at a time
    (each piece a 1-D array of :func:`token_dtype`), for a writer that does not hold it whole."""
    dtype = token_dtype(len(tokenizer))
    eos = tokenizer.eos_token_id
    total = 0
    for start in range(0, len(texts), ENCODE_CHUNK_DOCS):
        if max_tokens is not None and total >= max_tokens:
            return
        encoded = encode_texts(tokenizer, texts[start : start + ENCODE_CHUNK_DOCS])
        piece = np.concatenate([np.asarray([*ids, eos], dtype=dtype) for ids in encoded])
        if max_tokens is not None:
            piece = piece[: max_tokens - total]
        total += len(piece)
        yield piece


def build_tokenizer(
    name: str,
    *,
    vocab_size: int,
    corpus_id: str,
    training_texts: Callable[[], Sequence[str]],
    cache_dir: str | Path,
) -> tuple[PreTrainedTokenizerBase, str]:
    """Return ``(tokenizer, description)`` for a ``DataSpec.tokenizer`` value.

    ``"bpe"`` -> the cached BPE of this corpus (description ``"bpe<V>-<hash>"``); anything else
    -> :func:`load_pretrained_tokenizer` (description: the name).
    """
    if name == BPE:
        return load_or_train_bpe(corpus_id, training_texts, vocab_size, cache_dir)
    return load_pretrained_tokenizer(name), name
